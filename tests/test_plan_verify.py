"""`labkit.plan.verify` measures a plan's step on fake tensors as a plain step with the same levers measures on real
ones: each lever below is written here the plain way (torch, transformers, peft, labkit's offload), run on a real
tiny Llama under `lk.track`, and the fake-tensor measurement must agree within 2% (issue 35)."""
import numpy as np
import pytest
import torch

import labkit as lk
from labkit.launch import fake_ranks
from labkit.plan import verify as V

SEQ, MICRO = 128, 2
CFG = lk.models.config("llama-2-7b", "tiny")


def fake(task, **levers):
    parts, source, only, tools, notes = V.measure(CFG, task, levers, SEQ, device="fake")
    return sum(parts.values())


def build(dtype=torch.float32, attention="sdpa"):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return AutoModelForCausalLM.from_config(CFG, attn_implementation=attention).train()
    finally:
        torch.set_default_dtype(old)


def recompute(model):
    """transformers' switch for full recomputation (renamed in 5.24; 5.17 has the old name only)."""
    on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    on({"use_reentrant": False})


def ids():
    return torch.randint(0, CFG.vocab_size, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))


def within_2_percent(measured, reference):
    assert abs(measured / reference - 1) < 0.02, f"verify {measured:,} B, plain step {reference:,} B"


def test_fp32_adamw_step_agrees():
    model, x = build(), ids()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for tracked in (False, True):                  # the first step makes Adam's state; the second is measured
        with lk.track(model, opt) if tracked else lk.track() as mem:
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    within_2_percent(fake("finetune", dtype="fp32", micro_batch=MICRO), mem.peak)


def test_mixed_precision_with_recompute_and_accumulation_agrees():
    """bf16 weights and gradients, fp32 master weights and AdamW on them, an fp32 accumulation buffer."""
    model, x = build(torch.bfloat16), ids()
    recompute(model)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters, foreach=False)
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt.step()
    opt.zero_grad(set_to_none=True)
    with lk.track(model, opt) as mem:
        mem.label(masters, "optimizer")
        for _ in range(2):                         # two micro-batches into the fp32 buffer
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
            for p, m in zip(params, masters):
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    within_2_percent(fake("finetune", dtype="mixed", recompute=True, micro_batch=MICRO, grad_accum=2), mem.peak)


def test_pure_bf16_with_the_step_fused_into_backward_and_chunked_loss_agrees():
    """PyTorch's tutorial: one optimizer per parameter, stepped by a post-accumulate-grad hook; the loss from the
    hidden states through labkit.kernels.linear_cross_entropy, 1024 rows of logits at a time."""
    from labkit.kernels import linear_cross_entropy
    model, x = build(torch.bfloat16), ids()
    opts = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}
    for p, opt in opts.items():
        p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def hook(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    with lk.track(model, *opts.values()) as mem:
        hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
        targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], 1).reshape(-1)
        linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, targets, chunk=1024).backward()
    within_2_percent(fake("finetune", dtype="bf16", fused_step=True, chunked_ce=True, micro_batch=MICRO), mem.peak)


def test_autocast_with_activation_offload_and_eager_attention_agrees():
    from labkit.offload import ActivationOffload
    model, x = build(attention="eager"), ids()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for tracked in (False, True):
        with lk.track(model, opt) if tracked else lk.track() as mem:
            with torch.autocast("cpu", dtype=torch.bfloat16), ActivationOffload("host", keep=model):
                loss = model(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
    within_2_percent(fake("finetune", dtype="amp-bf16", activation_offload=True, attention="eager",
                          micro_batch=MICRO), mem.peak)


def test_zero_offload_streaming_gradients_to_the_host_agrees():
    """ZeRO-Offload on one GPU: each gradient goes to the host (numpy) as soon as backward makes it; the device
    keeps the bf16 weights and the activations."""
    from labkit.offload import to_host
    model, x = build(torch.bfloat16), ids()
    host = {}

    def hook(p):
        host[p] = to_host(p.grad)[0]
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    with lk.track(model) as mem:
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
    assert sum(b.nbytes for b in host.values()) == 2 * sum(p.numel() for p in model.parameters())
    within_2_percent(fake("finetune", dtype="mixed", zero=2, offload="optimizer", micro_batch=MICRO), mem.peak)


def test_lora_on_every_linear_with_recompute_agrees_with_peft():
    import warnings
    from peft import LoraConfig, get_peft_model
    model, x = build(torch.bfloat16), ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
            f"{t}_proj" for t in ("q", "k", "v", "o", "gate", "up", "down")]))
    recompute(model)
    model.enable_input_require_grads()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.float32 for p in trainable), "peft keeps adapters in fp32 beside a bf16 base"
    opt = torch.optim.AdamW(trainable, foreach=False)
    for tracked in (False, True):
        with lk.track(model, opt) if tracked else lk.track() as mem:
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    within_2_percent(fake("lora", rank=8, recompute=True, micro_batch=MICRO), mem.peak)


def test_one_fsdp_rank_agrees_with_the_profiler_on_real_tensors():
    """ZeRO-3 over 4 ranks: FSDPMemTracker on fake tensors (verify) against torch.profiler's allocations of a real
    rank (real tensors, fake collectives) plus what lived before the step: the local shards, Adam's state, the ids."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with fake_ranks(4):
        mesh = init_device_mesh("cpu", (4,))
        model, x = build(), ids()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)

        def step():
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        before = sum(t.to_local().untyped_storage().nbytes() if hasattr(t, "to_local") else t.untyped_storage().nbytes()
                     for t in [*model.parameters(), *model.buffers(), x,
                               *(v for s in opt.state.values() for v in s.values())])
        with lk.track(backend="profiler") as mem:
            step()
    assert fake("finetune", dtype="fp32", zero=3, dp=4, micro_batch=MICRO) > 0
    within_2_percent(fake("finetune", dtype="fp32", zero=3, dp=4, micro_batch=MICRO), before + mem.peak)


def test_serving_one_prefill_agrees():
    """bf16 weights, one sequence's prefill with its cache (SEQ is a whole number of 16-token blocks)."""
    model, x = build(torch.bfloat16), ids()[:1]
    model.eval()
    with torch.no_grad(), lk.track(model) as mem:
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        mem.label(lk.models.cache_of(out), "kv_cache")
    parts, source, *_ = V.measure(CFG, "serve", dict(weights="bf16"), SEQ, batch=1, device="fake")
    within_2_percent(sum(parts.values()), mem.peak)
    assert parts["kv_cache"] == 2 * 2 * CFG.num_hidden_layers * SEQ * CFG.hidden_size    # K and V, bf16


def test_levers_fake_tensors_cannot_run_come_from_the_formula_and_say_so():
    plan_parts = dict(parameters=1000, gradients=0, optimizer=777, activations=5, other=0)
    parts, source, only, tools, notes = V.measure(CFG, "finetune", dict(dtype="bf16", optimizer="paged-adamw-8bit"),
                                                  SEQ, device="fake", plan_parts=plan_parts)
    assert parts["optimizer"] == 777 and source["optimizer"].startswith("formula")
    bf16 = build(torch.bfloat16)
    assert source["parameters"] == "measured" and parts["parameters"] == sum(
        t.untyped_storage().nbytes() for t in [*bf16.parameters(), *bf16.buffers()])
    assert any("bitsandbytes" in o for o in only)
    assert any("step that ran" in name for name in tools)


def test_tensor_parallel_plans_are_not_measured_and_say_why():
    parts, source, only, tools, notes = V.measure(CFG, "finetune", dict(tp=2), SEQ, device="fake")
    assert parts is None and any("tp=2" in n for n in notes)


def test_bad_input_is_refused_before_any_work():
    with pytest.raises(ValueError, match="task must be"):
        V.measure(CFG, "train", {}, SEQ)
    with pytest.raises(ValueError, match="device must be"):
        V.measure(CFG, "finetune", {}, SEQ, device="gpu")
    with pytest.raises(ValueError, match="fused_step=True with grad_accum=4"):
        V.measure(CFG, "finetune", dict(fused_step=True, grad_accum=4), SEQ)
    with pytest.raises(ValueError, match=r"levers\['dtype'\] must be one of .*got 'fp16'"):
        V.measure(CFG, "finetune", dict(dtype="fp16"), SEQ)
    with pytest.raises(ValueError, match=r"levers\['micro_batch'\] must be an int >= 1, got 0"):
        V.measure(CFG, "finetune", dict(micro_batch=0), SEQ)
    with pytest.raises(TypeError, match="plans must be what labkit.plan.plan returns"):
        V.verify([{"levers": {}}])


def test_runtime_estimator_says_why_it_does_not_run_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the estimator runs")
    parts, source, only, tools, notes = V.measure(CFG, "finetune", dict(dtype="fp32"), SEQ, runtime=True)
    assert tools["torch RuntimeEstimator"].startswith("not run: its roofline reads a CUDA GPU")


def test_verify_reads_the_top_plan_and_prints_it_beside_the_formula():
    from labkit.plan import plan
    plans = plan(CFG, "finetune", "564 MiB", seq=SEQ, batch=4)     # 64 MiB beside the CUDA context
    v = V.verify(plans, config=CFG)
    assert v.techniques == plans[0].techniques and v.formula_peak == sum(
        plans[0].parts[c] for c in V.CATS)
    text = v.table()
    assert "plan (formula)" in text and "gap" in text and np.isfinite(v.gap)
    with pytest.raises(ValueError, match="index must be"):
        V.verify(plans, index=len(plans), config=CFG)


def test_torchtunes_chunked_output_loss_agrees():
    """torchtune's CEWithChunkedOutputLoss: the logits in 8 chunks of the sequence, each upcast on its own."""
    model, x = build(torch.bfloat16), ids()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for tracked in (False, True):
        with lk.track(model, opt) if tracked else lk.track() as mem:
            hidden = model.model(input_ids=x, use_cache=False).last_hidden_state
            targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], 1)
            loss = sum(torch.nn.functional.cross_entropy(model.lm_head(h).flatten(0, 1).float(), t.flatten(),
                                                         reduction="sum")
                       for h, t in zip(hidden.chunk(8, dim=1), targets.chunk(8, dim=1))) / (targets != -100).sum()
            loss.backward()
            del loss, hidden
            opt.step()
            opt.zero_grad(set_to_none=True)
    within_2_percent(fake("finetune", dtype="bf16", chunked_ce="output", micro_batch=MICRO), mem.peak)


def _plan_gap(task, budget, **levers):
    from labkit.plan import plan
    plans = plan(CFG, task, budget, seq=SEQ, batch=4, levers=levers)
    return V.verify(plans, config=CFG)


@pytest.mark.parametrize("levers", [dict(recompute=True), dict(recompute=True, activation_offload=True),
                                    dict(recompute=False), dict(recompute=True, micro_batch=1)])
def test_a_qlora_plan_verifies_as_its_formula_says(levers):
    """The adapters' activations live where the layer's do: in every layer as backward starts, in the one
    recomputed layer with full recomputation; their gradients only once backward has made them (or from
    earlier micro-batches); the frozen head makes no weight gradient in a chunked loss."""
    v = _plan_gap("qlora", "564 MiB", **levers)
    assert abs(v.gap) < 0.03, (levers, v.gap, v.formula, v.measured)


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "amp-bf16"])
def test_accumulation_without_an_fp32_buffer_verifies(dtype):
    """Two micro-batches summed into .grad: the first one's gradients are alive through the second backward."""
    v = _plan_gap("finetune", "1 GiB", dtype=dtype, optimizer="adamw", micro_batch=1, offload=None, zero=0,
                  activation_offload=False)
    assert v.levers["grad_accum"] == 4 and abs(v.gap) < 0.02, (dtype, v.gap)
    assert v.formula["gradients"] > 0 and v.measured["gradients"] == v.formula["gradients"]


def test_a_paged_state_is_held_apart_from_what_the_allocator_serves():
    """A paged 8-bit state fills what the card leaves: the plan's resident share and the one the measured
    step leaves are shown apart, and the gap is taken on what PyTorch's allocator serves."""
    from labkit.plan import CUDA_CONTEXT, plan
    levers = dict(optimizer="paged-adamw-8bit", dtype="bf16", recompute=True, fused_step=True, chunked_ce=True,
                  activation_offload=False, micro_batch=4)
    roomy = plan(CFG, "finetune", "1 GiB", seq=SEQ, batch=4, levers=levers)[0]
    card = CUDA_CONTEXT + roomy.counted_bytes + roomy.parts["optimizer"] // 2     # half the state fits beside
    plans = plan(CFG, "finetune", card, seq=SEQ, batch=4, levers=levers)
    top = plans[0]
    assert top.fits and top.host.get("paged", 0) > 0, "the card holds part of the state: the rest is paged"
    v = V.verify(plans, config=CFG)
    served_f, served_m = v.formula_peak - v.paged[0], v.measured_peak - v.paged[1]
    assert v.paged[0] == top.peak_bytes - top.counted_bytes
    assert served_m + v.paged[1] + v.allocator == top.budget           # the measured step leaves the rest
    assert v.gap == pytest.approx(served_m / served_f - 1) and abs(v.gap) < 0.02
    assert "paged state" in v.table() and "served" in v.table()


def test_a_recomputed_layers_backward_at_7b_width_on_fake_tensors():
    """Notebook 13's 7B step, two layers deep: the peak inside the recomputed layer's backward, as the formula
    prices it (3 x 172 MiB + 64 MiB of gradients in "other" at 4 x 2048 tokens)."""
    from labkit.estimate import model_shape
    from labkit.estimate.formulas import training_step
    from labkit.estimate.levers import layer_backward_bytes
    cfg = lk.models.config("llama-2-7b", "full", num_hidden_layers=2)
    levers = dict(dtype="bf16", optimizer="adamw", fused_step=True, recompute=True, chunked_ce=True, micro_batch=4)
    parts, *_ = V.measure(cfg, "finetune", levers, 2048, device="fake")
    s = model_shape(cfg)
    est = training_step(s, 4, 2048, "bf16", "adamw", True, False, False, "cuda", None, fused_step=True,
                        chunked_ce=True)
    assert est.phase == "recomputation" and abs(sum(parts.values()) / est.total - 1) < 0.02
    assert 4 * 2048 * layer_backward_bytes(s, 2)[1] == (3 * 172 + 64) * 2**20
    assert parts["other"] == pytest.approx((3 * 172 + 64) * 2**20, abs=64)      # and a few scalars
