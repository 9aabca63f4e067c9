"""lk.plan: each lever's formula held to a measurement of the real thing at tiny size (lk.track around PyTorch's,
bitsandbytes', peft's or labkit's own implementation), the capacity model, answers that are never silent, the
cost model's rules, and the published recipes of data/recipes.csv.

Tolerances: the estimate's formulas are exact up to small tensors they leave out (norm statistics, masks,
scalars): 5% at tiny size on a CPU (fp32 or bf16), as tests/test_estimate_families.py holds them; recipes'
measured peaks within 15% (the issue's bar: other frameworks' kernels, a GPU's counters).
"""
import json

import pytest
import torch

import labkit as lk
from labkit.cli import main
from labkit.estimate import model_shape
from labkit.estimate.formulas import layer_terms
from labkit.estimate.levers import CE_CHUNK
from labkit.plan import (ALL_TARGETS, CUDA_CONTEXT, LAST_TIME, adam8bit_state_bytes, adapter_state_bytes,
                         data_parallel_bytes, default_host_memory, frozen_base_saving, gathered_unit_bytes, gpu_names,
                         gpu_spec, host_bytes, int8_bits, kv_bytes, kv_capacity_tokens, lora_activation_bytes,
                         lora_params, nf4_bits, offload_bytes, offload_seconds, paged_kv_tokens, paged_optimizer,
                         parse_levers, plan, quantized_input_bytes, quantized_weight_bytes, rank_key, recipe_answer,
                         recipes, state_rounding, step_fragmentation, train_flops)
from labkit.plan.shapes import layer_params, param_shapes
from labkit.units import GiB, MiB

RECIPES = {r["name"]: r for r in recipes()}
B, S = 2, 256                                  # the tiny step: two sequences of 256 tokens


def tiny(name="llama-3-8b", **overrides):
    model = lk.models.build(name, "tiny", **overrides)
    model.train()
    return model


def tracked(model, step, *objs):
    """lk.track of the second call of `step` (the first makes the optimizer state)."""
    step()
    with lk.track(model, *objs) as mem:
        step()
    return mem


def formula(config, batch=B, seq=S, optimizer="adamw", dtype="fp32", **levers):
    return lk.estimate(config, batch, seq, dtype, optimizer, device="cpu", method="formula", **levers)


# ---- levers, each against the real thing -----------------------------------------------------------
def test_fused_optimizer_step_holds_one_gradient_as_the_formula_says():
    """A post-accumulate-grad hook per parameter (PyTorch's tutorial, torchtune's optimizer_in_bwd): at a
    size where the plain step peaks in optimizer.step(), the fused one peaks lower by about the gradients."""
    ids = torch.randint(0, 4096, (1, 16))
    plain = tiny()
    opt = torch.optim.AdamW(plain.parameters(), foreach=False)

    def plain_step():
        plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    fused = tiny()
    opts = {p: torch.optim.AdamW([p], foreach=False) for p in fused.parameters()}

    def step_now(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for p in fused.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    measured_plain = tracked(plain, plain_step, opt).peak
    measured = tracked(fused, lambda: fused(input_ids=ids, labels=ids, use_cache=False).loss.backward(),
                       *opts.values()).peak
    est = formula(fused.config, 1, 16, fused_step=True)
    assert abs(measured / est.total - 1) < 0.05 and est.phase == "fused step"
    grads = sum(p.numel() * 4 for p in plain.parameters())
    assert measured_plain - measured > 0.5 * grads          # the gradients no longer live all at once
    assert abs(formula(plain.config, 1, 16).total / measured_plain - 1) < 0.05


def test_accumulating_micro_batches_keeps_their_gradients_alive_as_the_formula_says():
    """A plain loop that sums two bf16 micro-batches into .grad: the first one's gradients are alive through
    the second backward (no fp32 buffer: grad_accum=False); without `accumulate` the formula misses them."""
    ids = torch.randint(0, 4096, (1, 128))
    model = tiny(dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)

    def step():
        for _ in range(2):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = tracked(model, step, opt).peak
    est = lk.estimate(model.config, 1, 128, "bf16", "adamw", device="cpu", method="formula", accumulate=True)
    one = lk.estimate(model.config, 1, 128, "bf16", "adamw", device="cpu", method="formula")
    assert abs(measured / est.total - 1) < 0.02 and est.phase == "start of backward"
    assert measured > 1.1 * one.total                          # the gradients a single micro-batch has not
    assert est.peak_parts["gradients"] == 2 * sum(p.numel() for p in model.parameters())


def test_a_recomputed_layers_backward_is_the_peak_the_formula_says():
    """Notebook 13's plan (bf16, full recomputation, the step fused into backward, notebook 12's chunked loss)
    on a tiny Llama with a small vocabulary, so that the loss is not the peak: the top layer, recomputed, in
    its backward (its inputs, that layer's activations and its MLP's gradients: levers.layer_backward_bytes)."""
    from labkit.estimate.levers import layer_backward_bytes
    from labkit.kernels import linear_cross_entropy
    model = tiny(dtype=torch.bfloat16, vocab_size=256, intermediate_size=1024)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    opts = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}

    def step_now(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    ids = torch.randint(0, 256, (B, 512))

    def step():
        hidden = model.model(input_ids=ids).last_hidden_state
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1).reshape(-1)
        linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, targets,
                             chunk=CE_CHUNK).backward()

    mem = tracked(model, step, *opts.values())
    est = lk.estimate(model.config, B, 512, "bf16", "adamw", device="cpu", method="formula", recompute=True,
                      fused_step=True, chunked_ce=True)
    assert abs(mem.peak / est.total - 1) < 0.02 and est.phase == "recomputation"
    made = B * 512 * layer_backward_bytes(model_shape(model.config), 2)[1]
    assert mem.peak_parts["other"] == pytest.approx(made, rel=0.01)       # 3 e i + e h per token, measured


def test_autocast_with_recomputation_keeps_the_casts_of_one_layer_as_the_formula_says():
    """Under autocast a checkpointed layer keeps no 16-bit weight copy; the output layer's stays, the
    recomputed layer makes its own again."""
    model = tiny(vocab_size=256, intermediate_size=1024)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    ids = torch.randint(0, 256, (B, S))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = tracked(model, step, opt).peak
    est = formula(model.config, recompute=True, dtype="amp-bf16")
    assert abs(measured / est.total - 1) < 0.02 and est.phase == "recomputation"


def test_fused_step_refuses_accumulation():
    with pytest.raises(ValueError, match="fused_step"):
        lk.estimate("llama-2-7b", 1, 512, "mixed", "adamw", method="formula", grad_accum=True, fused_step=True)
    with pytest.raises(ValueError, match="fused_step"):
        lk.estimate("llama-2-7b", 1, 512, "bf16", "adamw", method="formula", accumulate=True, fused_step=True)


def test_eight_bit_adamw_state_is_bitsandbytes_bytes():
    """bitsandbytes' AdamW8bit on a CPU: uint8 moments, an fp32 absmax per block of 256, 32-bit state for
    tensors under 4096 elements (the tiny model's norms), the shared quantization maps once."""
    bnb = pytest.importorskip("bitsandbytes")
    ids = torch.randint(0, 4096, (1, 16))
    for cls in (bnb.optim.AdamW8bit, bnb.optim.PagedAdamW8bit):
        model = tiny()
        opt = cls(model.parameters(), lr=1e-3)

        def step():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        mem = tracked(model, step, opt)
        numels = [p.numel() for p in model.parameters()]
        assert mem.peak_parts["optimizer"] == adam8bit_state_bytes(numels), cls          # to the byte
        assert adam8bit_state_bytes(numels) < 0.3 * 8 * sum(numels)          # against AdamW's fp32 moments


def test_eight_bit_adamw_state_of_the_fused_step_has_maps_per_optimizer():
    """The fused step makes one AdamW8bit per parameter (labkit.plan.verify.Step, torchtune's optimizer_in_bwd):
    each optimizer with 8-bit state holds its own two quantization maps, not one pair for all tensors."""
    assert adam8bit_state_bytes([4096] * 3, per_parameter=True) == 3 * (2 * 4096 + 8 * 16 + 2 * 256 * 4)
    assert adam8bit_state_bytes([4096] * 3) == 3 * (2 * 4096 + 8 * 16) + 2 * 256 * 4
    assert adam8bit_state_bytes([128, 4095], per_parameter=True) == adam8bit_state_bytes([128, 4095]) == 8 * 4223
    bnb = pytest.importorskip("bitsandbytes")
    ids = torch.randint(0, 4096, (1, 16))
    model = tiny()
    opts = [bnb.optim.AdamW8bit([p], lr=1e-3) for p in model.parameters()]

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    mem = tracked(model, step, *opts)
    numels = [p.numel() for p in model.parameters()]
    assert mem.peak_parts["optimizer"] == adam8bit_state_bytes(numels, per_parameter=True)     # to the byte


def test_paging_changes_nothing_while_the_card_has_room():
    assert paged_optimizer(10 * GiB, 12 * GiB) == (10 * GiB, 0)
    assert paged_optimizer(10 * GiB, 4 * GiB) == (4 * GiB, 6 * GiB)          # the rest lives on the host
    assert paged_optimizer(10 * GiB, -1) == (0, 10 * GiB)


def test_activation_offload_keeps_the_device_peak_the_formula_says():
    """notebook 04's saved-tensor hooks (labkit.offload.ActivationOffload) with recomputation: the device
    holds what the formula leaves there, and at least the layers' inputs moved to the host."""
    from labkit.offload import ActivationOffload
    ids = torch.randint(0, 4096, (B, S))
    model = tiny()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    moved = []

    def step():
        off = ActivationOffload("host", keep=model)
        with off:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        moved.append(off.offloaded_bytes)

    mem = tracked(model, step, opt)
    est = formula(model.config, recompute=True, activation_offload=True)
    assert abs(mem.peak / est.total - 1) < 0.05
    assert est.host["activations"] == B * S * 4 * model.config.hidden_size * model.config.num_hidden_layers
    assert moved[-1] >= est.host["activations"]


def test_chunked_cross_entropy_keeps_no_logits_as_the_formula_says():
    """notebook 12's linear_cross_entropy (labkit.kernels) in place of the LM head and the loss."""
    from labkit.kernels import linear_cross_entropy
    ids = torch.randint(0, 4096, (B, S))
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)

    def step():
        hidden = model.model(input_ids=ids).last_hidden_state
        loss = linear_cross_entropy(hidden[:, :-1].reshape(-1, hidden.shape[-1]), model.lm_head.weight,
                                    ids[:, 1:].reshape(-1), chunk=CE_CHUNK)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = tracked(model, step, opt).peak
    est, plain = formula(model.config, chunked_ce=True), formula(model.config)
    assert abs(measured / est.total - 1) < 0.05
    assert plain.total - est.total > 0.1 * plain.total                       # the logits were a tenth of it


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eager_attention_keeps_the_score_matrix_as_the_formula_says(dtype):
    """fp32: the softmax's output; bf16: that and its cast to bf16 (the cast is the same tensor in fp32)."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ids = torch.randint(0, 4096, (B, S))
    config = tiny().config
    model = tiny(dtype=torch_dtype)
    model.set_attn_implementation("eager")
    opt = torch.optim.AdamW(model.parameters(), foreach=False)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = tracked(model, step, opt).peak
    eager = lk.estimate(config, B, S, dtype, "adamw", device="cpu", method="formula", attention="eager")
    sdpa = lk.estimate(config, B, S, dtype, "adamw", device="cpu", method="formula")
    assert abs(measured / eager.total - 1) < 0.05 and eager.total > 1.1 * sdpa.total


def _per_layer_activations(targets, adapter_fp32, seq=128):
    """Bytes per token one more layer adds to a bf16 LoRA step's peak activations (peft on a tiny Llama)."""
    peft = pytest.importorskip("peft")
    names = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
             "down": "down_proj"}
    acts = []
    for layers in (1, 2):
        model = tiny(dtype=torch.bfloat16, num_hidden_layers=layers)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=[names[t] for t in targets]),
                                    autocast_adapter_dtype=adapter_fp32)
        ids = torch.zeros(2, seq, dtype=torch.long)
        with lk.track(model) as mem:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        acts.append(mem.peak_parts["activations"])
    return (acts[1] - acts[0]) / (2 * seq)


@pytest.mark.parametrize("targets, adapter_dtype", [(("q", "v"), "fp32"), (ALL_TARGETS, "fp32"),
                                                    (("q", "k", "v", "o"), "bf16"), (ALL_TARGETS, "bf16")])
def test_lora_activations_per_layer_are_peft_measured(targets, adapter_dtype):
    """A frozen base keeps less than full training (no weight gradient needs the linears' inputs), the
    adapters add their inputs (cast to fp32 by peft's default) and A's outputs."""
    s = model_shape(lk.models.config("llama-3-8b", "tiny"))
    full, _ = layer_terms(s, 128, "bf16", device="cpu")
    want = full - frozen_base_saving(s) + lora_activation_bytes(s, 8, targets, 2, adapter_dtype)
    measured = _per_layer_activations(targets, adapter_dtype == "fp32")
    assert abs(measured / want - 1) < 0.03, (measured, want)


def test_lora_params_and_state_match_peft_at_any_rank_and_targets():
    peft = pytest.importorskip("peft")
    for rank, targets, names in ((8, ALL_TARGETS, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"]), (16, ("q", "v"), ["q_proj", "v_proj"])):
        model = peft.get_peft_model(tiny(), peft.LoraConfig(r=rank, target_modules=names))
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert lora_params(model.config, rank, targets) == sum(p.numel() for p in trainable)
        opt = torch.optim.AdamW(trainable, foreach=False)
        ids = torch.zeros(1, 16, dtype=torch.long)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.dim())
        assert state == adapter_state_bytes(lora_params(model.config, rank, targets), "adamw", "fp32")[2]
    with pytest.raises(ValueError, match="targets"):
        lora_params("llama-2-7b", 8, ("q", "lm_head"))


def test_nf4_weights_are_bitsandbytes_bytes_and_keep_no_input():
    """QLoRA's NF4 with double quantization (4.127 bits): bitsandbytes' Linear4bit on a CPU stores as many
    bytes; since bitsandbytes PR #1270 its matmul keeps no input for backward, as a frozen 16-bit layer."""
    bnb = pytest.importorskip("bitsandbytes")
    layer = bnb.nn.Linear4bit(4096, 4096, bias=False, compress_statistics=True, quant_type="nf4")
    layer = layer.to("cpu")
    st = layer.weight.quant_state
    stored = layer.weight.numel() * layer.weight.element_size() + st.absmax.numel() * st.absmax.element_size() \
        + st.state2.absmax.numel() * st.state2.absmax.element_size()
    assert stored == pytest.approx(4096 * 4096 * nf4_bits() / 8, rel=0.001)
    assert round(nf4_bits(), 3) == 4.127 and nf4_bits(double_quant=False) == 4.5 and int8_bits(4096) == 8 + 32 / 4096
    x = torch.randn(64, 4096, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    assert x.grad is not None and not any(t.shape == x.shape for t in saved)        # the input is not kept
    assert quantized_input_bytes(model_shape("llama-2-7b"), ("q", "v"), 2, "bf16") == 2 * (4096 + 4096 + 11008)


def test_quantized_weights_keep_embeddings_and_head_in_16_bits():
    from labkit.estimate import param_count
    P = param_count("llama-2-70b")
    assert quantized_weight_bytes("llama-2-70b", "bf16") == 2 * P
    rest = 2 * 32000 * 8192 + (2 * 80 + 1) * 8192          # embeddings, LM head, norms: 16-bit
    assert quantized_weight_bytes("llama-2-70b", "nf4") == int((P - rest) * nf4_bits() / 8 + 2 * rest)


def test_a_sharded_base_holds_its_shard_and_one_gathered_layer():
    """FSDP of a LoRA model: each GPU holds 1/dp of the frozen base and gathers a decoder layer (and the
    next one, prefetched) whole; the layer's parameters are the model's own."""
    model = lk.models.build("llama-2-7b", "tiny", device="meta")
    s = model_shape(model.config)
    assert layer_params(s) == sum(p.numel() for p in model.model.layers[0].parameters())
    assert sorted(param_shapes(s)) == sorted(p.numel() for p in model.parameters())
    s70 = model_shape("llama-2-70b")
    assert gathered_unit_bytes(s70, "bf16") == 2 * 2 * layer_params(s70)
    one = plan("data/configs/llama-3.1-70b", "lora", "A100 80GB", gpus=8, seq=2048, batch=16,
               levers=dict(rank=16, targets=("q", "v"), recompute=True, micro_batch=2))
    sharded = [p.parts["parameters"] for p in one if p.levers["shard_base"]]
    replicated = [p.parts["parameters"] for p in one if not p.levers["shard_base"]]
    assert sharded and replicated and max(sharded) < 0.3 * min(replicated)
    assert one.best.levers["shard_base"] and not any(p.fits for p in one if not p.levers["shard_base"])


# ---- capacity ---------------------------------------------------------------------------------------
def test_cards_are_what_the_driver_reports_each_with_its_source():
    cards = {"T4", "L4", "A10", "RTX 4090", "A100 40GB", "A100 80GB", "H100", "H200", "V100", "A6000"}
    assert cards <= set(gpu_names())
    assert gpu_spec("RTX 4090")["memory"] == 24564 * MiB and gpu_spec("H100")["memory"] == 81559 * MiB
    for name in gpu_names():
        g = gpu_spec(name)
        assert g["memory_source"] and g["source"].startswith("https://") and g["bf16_flops"] > g["fp32_flops"]
        assert g["usable"] == g["memory"] - CUDA_CONTEXT
    assert gpu_spec("24 GiB")["memory"] == 24 * GiB
    with pytest.raises(ValueError, match="CUDA context"):
        gpu_spec("100 MiB")


def test_state_rounding_is_what_the_allocator_model_reserves():
    """state_rounding (the allocator's rules applied to each long-lived tensor) against labkit.alloc
    replaying the same allocations: what it reserves beyond the bytes asked for."""
    from labkit import alloc
    sizes = [11 * MiB + 7, 16 * MiB, 33 * MiB + 1000, 23 * MiB // 2]        # segments rounded to 2 MiB
    trace = [(i, n) for i, n in enumerate(sizes)]
    assert state_rounding(sizes, 1) == alloc.replay(trace).peak_reserved - sum(sizes) > 0
    assert state_rounding([2 * MiB] * 10, 2) == 0                            # whole 2 MiB multiples: none


def test_the_allocators_excess_does_not_grow_with_depth():
    """The replayed step's excess (smallest device that runs it, less its live peak) at 2 and 4 layers."""
    two = step_fragmentation("llama-2-7b", 1, 512, layers=2)["fit"]
    four = step_fragmentation("llama-2-7b", 1, 512, layers=4)["fit"]
    assert abs(two - four) <= max(32 * MiB, 0.1 * two)


def test_host_memory_is_a_constraint_with_a_stated_default():
    assert default_host_memory("L4", 1) == 64 * GiB and default_host_memory("H100", 8) == 2 * 8 * 81559 * MiB
    assert host_bytes({"optimizer": 100, "gradients": 20, "activations": 50}, ranks=2) == 2 * (1.5 * 120 + 50)
    # a 70B full fine-tune "on one 48 GB card" through parameter offload needs over a terabyte of host memory
    small = plan("llama-2-70b", "finetune", "A6000", seq=512, levers=dict(offload="parameters"))
    assert small.best is None and "host memory" in small.advice()
    big = plan("llama-2-70b", "finetune", "A6000", seq=512, levers=dict(offload="parameters"), host_memory="2 TiB")
    assert big.best and big.best.host_bytes > 1e12


def test_a_trillion_parameters_do_not_train_on_one_h200_without_the_host_to_hold_them():
    cfg = lk.models.config("llama-2-70b", "full", hidden_size=16384, intermediate_size=53248, num_hidden_layers=400,
                           num_attention_heads=128, num_key_value_heads=8)
    plans = plan(cfg, "finetune", "H200", seq=512)
    assert plans.question["params"] > 1.2e12 and plans.best is None
    assert "host memory" in plans.advice() or "nothing fits" in plans.advice()


# ---- answers, never silence -------------------------------------------------------------------------
def test_nothing_fits_says_the_smallest_peak_the_category_and_the_lever():
    plans = plan("llama-2-70b", "finetune", "T4", seq=2048, host_memory="64 GiB")
    advice = plans.advice()
    assert plans.best is None and len(plans) > 0
    assert advice.startswith("nothing fits") and "What would" in advice
    assert "nothing fits" in plans.table(3)
    crowd = plan("llama-2-7b", "serve", "L4", seq=4096, batch=1000)         # the closest has an 8-bit cache
    assert crowd.best is None and crowd[0].levers["kv_dtype"] == "int8"
    assert "What would shrink kv_cache: fewer concurrent sequences or more GPUs" in crowd.advice()


@pytest.mark.parametrize("kwargs, named", [
    (dict(task="train"), "task"), (dict(gpu="B300"), "gpu"), (dict(gpus=0), "gpus"), (dict(seq=0), "seq"),
    (dict(batch=1.5), "batch"), (dict(model="no-such-model"), "no-such-model"), (dict(seq=10**6), "seq"),
    (dict(model="gpt2-124m"), "gpt2"), (dict(gpus=3), "batch 1 cannot be split over 3 GPUs"),
    (dict(task="lora", gpus=2, batch=3), "batch 3 is not divisible by gpus=2"),
    (dict(levers=dict(colour="red")), "colour"), (dict(host_memory="lots"), "host_memory"),
    (dict(levers=dict(dtype="fp16")), r"levers\['dtype'\] must be one of .*got 'fp16'"),
    (dict(levers=dict(recompute=1)), r"levers\['recompute'\] must be one of .*got 1"),
    (dict(levers=dict(micro_batch=0)), r"levers\['micro_batch'\] must be an int >= 1, got 0"),
    (dict(task="lora", levers=dict(lora_dropout=2)), "lora_dropout"),
    (dict(task="lora", gpus=2, batch=2, levers=dict(dp=1)), r"levers\['dp'\] must be gpus=2"),
    (dict(levers=dict(grad_accum=3)), "no plan can express these levers.*grad_accum"),
    (dict(gpu="4090"), r"did you mean RTX 4090"), (dict(gpu="A100"), r"A100 40GB or A100 80GB"),
])
def test_bad_input_is_named_with_its_value(kwargs, named):
    args = dict(model="llama-2-7b", task="finetune", gpu="L4") | kwargs
    with pytest.raises(ValueError, match=named):
        plan(**args)


def test_options_the_formulas_cannot_price_are_named_with_why(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(lk.models.config("llama-2-7b", "full", attention_dropout=0.1).to_json_string())
    with pytest.raises(ValueError, match="attention_dropout=0.1.*cannot price"):
        plan(str(path), "finetune", "L4")


@pytest.mark.parametrize("impl, attention", [("flash_attention_2", "sdpa"), ("flex_attention", "sdpa"),
                                             ("eager", "eager")])
def test_a_config_naming_its_attention_is_priced_as_that_kernel_keeps(impl, attention, tmp_path):
    """FlashAttention and flex attention keep what SDPA's flash kernel keeps; eager keeps the score matrix.
    No kernel is imported (flash-attn need not be installed)."""
    cfg = lk.models.config("llama-2-7b", "full")
    cfg._attn_implementation = impl
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    plans = plan(cfg, "finetune", "H100", seq=1024)
    assert plans.question["attention"] == attention and all(p.levers["attention"] == attention for p in plans)
    same = plan("llama-2-7b", "finetune", "H100", seq=1024, attention=attention)
    assert [p.peak_bytes for p in plans] == [p.peak_bytes for p in same]


def test_per_layer_config_lists_follow_the_replayed_depth():
    """Qwen2's layer_types lists one entry per layer: the allocator's replay at 2 layers cuts it to 2."""
    plans = plan("qwen2-7b", "qlora", "T4", seq=512)
    assert plans.best is not None and plans.question["config"].num_hidden_layers == 28


def test_fixed_levers_are_honoured_not_ignored():
    serve = plan("llama-2-7b", "serve", "L4", batch=8, levers=dict(block_size=32))
    assert {p.levers["block_size"] for p in serve} == {32} and "blocks of 32" in serve[0].techniques[1]
    accum = plan("llama-2-7b", "finetune", "L4", batch=4, levers=dict(grad_accum=4))
    assert {(p.levers["micro_batch"], p.levers["grad_accum"]) for p in accum} == {(1, 4)}
    eager = plan("llama-2-7b", "finetune", "L4", batch=4, levers=dict(attention="eager"))
    assert {p.levers["attention"] for p in eager} == {"eager"}


def test_verify_without_its_module_says_so(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "labkit.plan.verify", None)
    with pytest.raises(ImportError, match="labkit.plan.verify"):
        plan("llama-2-7b", "lora", "L4", seq=512, verify=True)


# ---- the cost model ---------------------------------------------------------------------------------
def test_pure_bf16_ranks_after_every_plan_with_fp32_master_weights():
    plans = plan("llama-2-7b", "finetune", "A100 80GB", seq=2048, batch=4)
    fits = [p for p in plans if p.fits]
    tiers = [p.levers["dtype"] == "bf16" for p in fits]
    assert tiers == sorted(tiers) and not tiers[0] and any(tiers)
    fastest_bf16 = min((p for p in fits if p.levers["dtype"] == "bf16"), key=lambda p: p.step_time_s)
    assert fastest_bf16.step_time_s <= fits[0].step_time_s          # as fast or faster, and still ranked after


def test_ranking_is_fit_tier_time_peak_then_levers():
    plans = plan("llama-2-7b", "finetune", "RTX 4090", seq=2048, batch=4, host_memory="256 GiB")
    keys = [rank_key(p, "finetune") for p in plans]
    assert keys == sorted(keys) and any(p.fits for p in plans) and not all(p.fits for p in plans)
    for p in plans:
        assert sum(p.parts.values()) == p.peak_bytes and (p.why == "") == p.fits
        assert p.fits == (p.counted_bytes <= p.budget and p.host_bytes <= p.host_budget)


def test_zero3_and_offload_pay_every_micro_batch_alike():
    W = 100
    assert data_parallel_bytes(8, 3, W, W, 4) == 4 * data_parallel_bytes(8, 3, W, W, 1)   # gathers per micro-batch
    assert data_parallel_bytes(8, 0, W, W, 4) == data_parallel_bytes(8, 0, W, W, 1)       # one all-reduce per step
    assert offload_bytes(100, "optimizer", 4) == 500 and offload_bytes(100, "parameters", 1) == 400
    assert offload_seconds(100, "optimizer", 1, 10, gpu_spec("L4")) == pytest.approx(200 / 32e9 + 320 / 50e9)
    assert train_flops(10, 100) == 6000 and train_flops(10, 100, recompute=True) == 8000
    assert train_flops(10, 100, frozen=True) == 4000


def test_serving_prices_prefill_and_decode():
    short = plan("llama-2-70b", "serve", "H100", gpus=8, seq=1024, batch=64)
    long = plan("llama-2-70b", "serve", "H100", gpus=8, seq=4096, batch=64)
    assert {"prefill", "decode"} <= set(short.best.cost) and long.best.cost["prefill"] > 3 * short.best.cost["prefill"]
    exact = [p for p in long if p.fits and p.levers["weights"] == "bf16" and p.levers["kv_dtype"] == "bf16"]
    assert long.best is exact[0] and exact[0].tokens_per_s == max(p.tokens_per_s for p in exact)


def test_paged_kv_and_capacity_as_vllm_sizes_them():
    assert paged_kv_tokens(4096, 16) == 4096 and paged_kv_tokens(4097, 16) == 4112
    assert kv_bytes("llama-2-7b", 2, 17, "bf16") == 2 * (2 * 32 * 4096 * 2) * 32
    assert kv_bytes("llama-2-7b", 2, 17, "int8") * 2 == kv_bytes("llama-2-7b", 2, 17, "bf16")
    tokens = kv_capacity_tokens("llama-2-7b", "A100 80GB")
    assert tokens % 16 == 0 and 100_000 < tokens < 140_000


# ---- published recipes ------------------------------------------------------------------------------
def test_recipes_cite_sources_configurations_and_kinds():
    rows = list(RECIPES.values())
    assert len(rows) >= 20 and len({r["source_name"].split(" (")[0] for r in rows}) >= 5
    for r in rows:
        assert r["source"].startswith("https://") and r["claim"] and r["config"], r["name"]
        assert r["kind"] in ("measured peak", "measured peak, settings not given", "measured maximum",
                             "measured capacity", "estimate", "claim"), r["name"]
        assert r["expect"] in ("fits", "does not fit") and (r["expressible"] == "full" or
                                                            r["expressible"].startswith("partly: "))
        assert r["gpu"] in gpu_names() or r["gpu"].endswith("GB"), r["name"]
        parse_levers(r["levers"])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_planner_agrees_with_every_published_recipe(name):
    answer = recipe_answer(RECIPES[name])
    assert answer["agrees"], (name, answer["fits"], answer["plan"].why)
    if answer["compared"]:                   # a measured peak the planner can express fully
        assert abs(answer["ratio"] - 1) <= 0.15, (name, answer["ratio"])


def test_last_rounds_three_plans_are_answered():
    for what, args in LAST_TIME.items():
        plans = plan(*args)
        assert plans.best is not None, what


# ---- the command line -------------------------------------------------------------------------------
def test_cli_prints_the_table_and_honours_rows_in_json(capsys):
    assert main(["plan", "llama-2-7b", "--task", "lora", "--gpu", "L4", "--seq", "1024", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "cost model: MFU" in out and "capacity:" in out
    assert main(["plan", "llama-2-7b", "--task", "lora", "--gpu", "L4", "--json", "--rows", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 2 and data["fits"] > 0 and data["question"]["task"] == "lora"
    assert {"techniques", "peak_bytes", "fits", "step_time_s", "parts", "levers", "host_bytes"} <= set(data["plans"][0])


@pytest.mark.parametrize("argv, named", [
    (["--gpu", "B300"], "B300"), (["--rows", "0"], "--rows must be >= 1, got 0"),
    (["--rows", "-3"], "--rows must be >= 1, got -3"), (["--gpus", "3"], "cannot be split over 3 GPUs"),
    (["--lever", "colour=red"], "colour"), (["--host-mem", "lots"], "host_memory"),
    (["--lever", "dtype=fp16"], "levers['dtype'] must be one of"), (["--gpu", "3090"], "with a unit"),
])
def test_cli_refuses_bad_input_in_one_line(argv, named, capsys):
    with pytest.raises(SystemExit) as err:
        main(["plan", "llama-2-7b", "--task", "finetune", "--gpu", "L4"] + argv)
    assert err.value.code == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if "error:" in l]
    assert len(lines) == 1 and named in lines[0]


def test_cli_says_why_nothing_fits_and_exits_1(capsys):
    assert main(["plan", "llama-2-70b", "--task", "finetune", "--gpu", "T4", "--host-mem", "64 GiB"]) == 1
    assert "nothing fits" in capsys.readouterr().out


def test_cli_fixes_levers(capsys):
    assert main(["plan", "llama-2-7b", "--task", "lora", "--gpu", "L4", "--lever", "rank=32",
                 "--lever", "targets=q+v", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {tuple(p["levers"]["targets"]) for p in data["plans"]} == {("q", "v")}
    assert {p["levers"]["rank"] for p in data["plans"]} == {32}
