"""lk.estimate per rank: data parallelism with the ZeRO stages (against the ZeRO paper and DeepSpeed's own
formulas), offload, tensor and pipeline parallelism, the Parallel layout and the layouts a model cannot have."""
import dataclasses
import functools

import pytest

import labkit as lk
from labkit.estimate import ZERO_STAGES, Parallel, load_config, model_states
from labkit.estimate.config import build_model

P = 7_500_000_000                       # the ZeRO paper's example (Fig. 1): 7.5B parameters, 64 ranks


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_the_zero_papers_example(stage, gb):
    states = model_states(P, dp=64, zero=stage)
    assert round(sum(states.values()) / 1e9, 1) == gb


@pytest.mark.parametrize("n", [1, 2, 4, 64])
def test_bytes_per_param_by_stage(n):
    per_param = [sum(model_states(1_000_000 * n, dp=n, zero=z).values()) / (1_000_000 * n) for z in ZERO_STAGES]
    assert per_param == [16, 2 + 2 + 12 / n, 2 + 14 / n, 16 / n]


def test_defaults_leave_the_estimate_unchanged():
    base = lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw")
    same = lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw", dp=1, zero=0, tp=1, pp=1)
    assert (same.total, same.parts, same.peak_parts) == (base.total, base.parts, base.peak_parts)
    assert model_states("llama-2-7b")["parameters"] == 2 * base.params


def test_each_stage_shards_one_more_category():
    kw = dict(batch=1, seq=1024, dtype="mixed", optimizer="adamw", dp=8)
    base = lk.estimate("llama-2-7b", **kw)
    z = {stage: lk.estimate("llama-2-7b", zero=stage, **kw) for stage in ZERO_STAGES}
    assert z[0].parts == base.parts, "dp alone replicates everything: DDP"
    assert z[1].parts["optimizer"] == -(-base.parts["optimizer"] // 8) and z[1].parts["gradients"] == base.parts["gradients"]
    assert z[2].parts["gradients"] == -(-base.parts["gradients"] // 8) and z[2].parts["parameters"] == base.parts["parameters"]
    gathered = 2 * z[3].largest_layer           # ZeRO-3 holds the largest module's 16-bit weights whole while it runs
    assert z[3].parts["parameters"] == -(-base.parts["parameters"] // 8) + gathered
    assert all(z[s].parts["activations"] == base.parts["activations"] for s in ZERO_STAGES), "ZeRO does not touch activations"
    assert z[0].total > z[1].total > z[2].total >= z[3].total


def test_tensor_and_pipeline_parallel_split_states_and_activations():
    base = lk.estimate("llama-2-70b", 1, 4096, "mixed", "adamw")
    tp = lk.estimate("llama-2-70b", 1, 4096, "mixed", "adamw", tp=8)
    pp = lk.estimate("llama-2-70b", 1, 4096, "mixed", "adamw", pp=8)
    assert tp.parts["parameters"] == pp.parts["parameters"] == -(-base.parts["parameters"] // 8)
    assert tp.parts["activations"] == -(-base.parts["activations"] // 8), "tensor + sequence parallel: / t"
    assert pp.parts["activations"] == base.parts["activations"], "1F1B: p micro-batches of L/p layers"
    assert "dp=1 x tp=8 x pp=1" in tp.table()


def test_recomputation_composes_with_sharding():
    kw = dict(batch=1, seq=4096, dtype="mixed", optimizer="adamw", dp=8, zero=3, tp=8, pp=2)
    plain, rc = lk.estimate("llama-2-70b", **kw), lk.estimate("llama-2-70b", recompute=True, **kw)
    assert rc.parts["activations"] < plain.parts["activations"] / 10
    assert rc.total < plain.total < 80e9


def test_inference_and_measured_paths_are_divided_too():
    inf = lk.estimate("llama-2-70b", 1, 4096, "bf16", training=False, tp=8)
    one = lk.estimate("llama-2-70b", 1, 4096, "bf16", training=False)
    assert inf.parts["parameters"] == -(-one.parts["parameters"] // 8)
    assert inf.parts["kv_cache"] == -(-one.parts["kv_cache"] // 8)


@pytest.mark.parametrize("kw, match", [
    (dict(dp=0), "dp must be an int >= 1, got 0"),
    (dict(tp=1.5), "tp must be an int >= 1, got 1.5"),
    (dict(pp=True), "pp must be an int >= 1, got True"),
    (dict(zero=4), r"zero must be one of \(0, 1, 2, 3\).*got 4"),
    (dict(zero="3"), r"zero must be one of .*got '3'"),
])
def test_bad_parallel_arguments_name_themselves(kw, match):
    with pytest.raises(ValueError, match=match):
        lk.estimate("llama-2-7b", 1, 512, **kw)
    with pytest.raises(ValueError, match=match):
        model_states(P, **kw)


def test_zero_is_for_training():
    with pytest.raises(ValueError, match="zero shards training state"):
        lk.estimate("llama-2-7b", 1, 512, "bf16", training=False, zero=3, dp=8)
    with pytest.raises(ValueError, match="params must be an int >= 1, got 0"):
        model_states(0)


def test_parallel_is_frozen_and_checked_at_construction():
    p = Parallel(dp=64, zero=3, tp=8)
    assert (p.dp, p.zero, p.tp, p.pp, p.offload, p.world) == (64, 3, 8, 1, None, 512)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.dp = 2
    assert dataclasses.replace(p, tp=4).world == 256
    for kwargs, message in [(dict(dp=0), "dp must be an int >= 1, got 0"),
                            (dict(tp=2.5), "tp must be an int >= 1, got 2.5"),
                            (dict(pp=True), "pp must be an int >= 1, got True"),
                            (dict(zero=4), "zero must be one of (0, 1, 2, 3)"),
                            (dict(zero=True), "zero must be one of"),
                            (dict(offload="gpu"), "offload must be None, 'optimizer' or 'parameters', got 'gpu'"),
                            (dict(zero=2, offload="parameters"), "use zero=3, got zero=2")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Parallel(**kwargs)


def test_parallel_and_the_flat_keywords_give_the_same_estimate():
    flat = lk.estimate("llama-2-7b", batch=2, seq=1024, dp=64, zero=3, tp=8, pp=2)
    grouped = lk.estimate("llama-2-7b", batch=2, seq=1024, parallel=Parallel(dp=64, zero=3, tp=8, pp=2))
    single = lk.estimate("llama-2-7b", batch=2, seq=1024)
    assert dataclasses.asdict(flat) == dataclasses.asdict(grouped)
    assert grouped.total < single.total / 8           # a real division, not a relabelling
    assert grouped.parallel["dp"] == 64 and grouped.parallel["zero"] == 3
    assert model_states(7_500_000_000, parallel=Parallel(dp=64, zero=1)) == model_states(7_500_000_000, dp=64, zero=1)


def test_parallel_and_flat_keywords_together_are_refused():
    with pytest.raises(ValueError, match="not both: got tp=2 too"):
        lk.estimate("llama-2-7b", parallel=Parallel(dp=2), tp=2)
    with pytest.raises(ValueError, match="not both"):
        model_states(10**9, dp=2, parallel=Parallel(dp=2))
    with pytest.raises(ValueError, match="parallel must be a labkit.estimate.Parallel"):
        lk.estimate("llama-2-7b", parallel={"dp": 2})


@pytest.mark.parametrize("kw, says", [
    (dict(tp=3), "tp=3 must divide num_attention_heads 32"),
    (dict(tp=64), "tp=64 must divide num_attention_heads 32"),
    (dict(pp=64), "pp=64 is more pipeline stages than num_hidden_layers 32"),
])
def test_a_layout_that_cannot_exist_is_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        lk.estimate("llama-2-7b", 1, 512, "bf16", **kw)
    with pytest.raises(ValueError, match=says):
        lk.estimate("llama-2-7b", 1, 512, "bf16", training=False, **kw)
    with pytest.raises(ValueError, match=says):
        lk.estimate("llama-2-7b", parallel=Parallel(**kw))


def test_tp_above_the_kv_heads_replicates_one_kv_head_per_rank():
    """llama-3-8b: 8 KV heads. tp=4 holds 2 per rank (1/4 of the cache); tp=8 and tp=16 hold one (1/8):
    the cache per rank never falls below one head's worth (vLLM's QKVParallelLinear replicates it)."""
    one = lk.estimate("llama-3-8b", 1, 1024, "bf16", training=False).parts["kv_cache"]
    per_rank = {tp: lk.estimate("llama-3-8b", 1, 1024, "bf16", training=False, tp=tp).parts["kv_cache"]
                for tp in (4, 8, 16, 32)}
    assert per_rank == {4: one // 4, 8: one // 8, 16: one // 8, 32: one // 8}
    assert lk.estimate("llama-3-8b", 1, 1024, "bf16", training=False, tp=16, pp=2).parts["kv_cache"] == one // 16
    cfg = lk.models.config("llama-3-8b", "full", num_key_value_heads=6, num_attention_heads=24, hidden_size=3072)
    with pytest.raises(ValueError, match="tp=4 and num_key_value_heads 6: one must divide the other"):
        lk.estimate(cfg, 1, 512, "bf16", tp=4)


# ---- beside DeepSpeed's estimate_zero2/3_model_states_mem_needs_all_cold: the per-GPU column -----------------
# DeepSpeed's formulas are written here as DeepSpeed writes them (deepspeed/runtime/zero/stage_1_and_2.py and
# stage3.py, estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs), computed in the test,
# not imported. DeepSpeed counts model states only (params, grads, optimizer state), in mixed precision with Adam
# and an fp32 gradient partition: lk.estimate(dtype="mixed", optimizer="adamw", grad_accum=True), summed over
# those three categories. P is chosen divisible by N, so DeepSpeed's int() and our per-category rounding agree
# to the byte.
def deepspeed_zero2_gpu(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True):
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
    return int(gpu_mem)


def deepspeed_zero3_gpu(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                        cpu_offload_params=True):
    total_gpus = num_nodes * num_gpus_per_node
    largest_layer_memory = (4 * largest_layer_params)
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
    return int(gpu_mem)


@functools.lru_cache(maxsize=None)
def params_of(name):
    return model_to_params(build_model(load_config(name), "meta"))


def model_to_params(model):
    """DeepSpeed's model_to_params (stage3.py), on a meta model: shared parameters once (by identity, as
    meta tensors have no data pointer), the largest module's own parameters."""
    total_params = sum(dict((id(p), p.numel()) for p in model.parameters()).values())
    largest_layer_params = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total_params, largest_layer_params


def states(est):
    return est.parts["parameters"] + est.parts["gradients"] + est.parts["optimizer"]


# The eight rows both functions print (ZeRO-3's zero_init changes only the CPU column: one GPU row each).
ROWS = [(2, True, False), (2, False, False), (3, True, True), (3, True, False), (3, False, False)]


@pytest.mark.parametrize("name, gpus", [("llama-2-7b", 8), ("llama-2-7b", 64), ("llama-2-13b", 8)])
@pytest.mark.parametrize("zero, cpu_offload, cpu_offload_params", ROWS)
def test_model_states_per_gpu_equal_deepspeeds_rows(name, gpus, zero, cpu_offload, cpu_offload_params):
    P, largest = params_of(name)
    assert P % gpus == 0 and P == lk.param_count(name)
    offload = "parameters" if cpu_offload_params else "optimizer" if cpu_offload else None
    est = lk.estimate(name, 1, 512, "mixed", "adamw", grad_accum=True, dp=gpus, zero=zero, offload=offload)
    if zero == 2:
        want = deepspeed_zero2_gpu(P, num_gpus_per_node=gpus, cpu_offload=cpu_offload)
    else:
        want = deepspeed_zero3_gpu(P, largest, num_gpus_per_node=gpus, cpu_offload=cpu_offload,
                                   cpu_offload_params=cpu_offload_params)
    assert est.largest_layer == largest
    assert states(est) == want
    kept = lk.estimate(name, 1, 512, "mixed", "adamw", grad_accum=True, dp=gpus, zero=zero)
    assert states(est) + sum(est.host.values()) == states(kept), "what left the GPU is in CPU memory"


def test_offload_arguments_are_checked():
    with pytest.raises(ValueError, match="offload must be None, 'optimizer' or 'parameters', got 'gpu'"):
        lk.estimate("llama-2-7b", offload="gpu")
    with pytest.raises(ValueError, match="offload='parameters' offloads the weight partitions of ZeRO-3.*got zero=2"):
        lk.estimate("llama-2-7b", dp=8, zero=2, offload="parameters")
    with pytest.raises(ValueError, match="for inference use offload=None"):
        lk.estimate("llama-2-7b", training=False, offload="optimizer")


def test_zero3_holds_the_largest_layer_gathered_only_outside_the_step():
    """The gathered weights and unreduced gradients exist while a layer runs (forward, backward), not in step()."""
    kw = dict(batch=1, seq=256, dtype="mixed", optimizer="adamw", dp=64, zero=3)
    est = lk.estimate("llama-2-7b", **kw)
    assert est.parts["parameters"] == -(-2 * lk.param_count("llama-2-7b") // 64) + 2 * est.largest_layer
    step = lk.estimate("llama-2-7b", 1, 16, "mixed", "adamw", dp=64, zero=3)
    if step.phase == "optimizer step":
        assert step.peak_parts["parameters"] == -(-2 * lk.param_count("llama-2-7b") // 64)
