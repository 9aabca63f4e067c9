"""lk.estimate beside DeepSpeed's estimate_zero2/3_model_states_mem_needs_all_cold: the per-GPU column.

DeepSpeed's formulas are written here as DeepSpeed writes them (deepspeed/runtime/zero/stage_1_and_2.py
and stage3.py, estimate_zero2_model_states_mem_needs / estimate_zero3_model_states_mem_needs), computed
in the test, not imported. DeepSpeed counts model states only (params, grads, optimizer state), in mixed
precision with Adam and an fp32 gradient partition: lk.estimate(dtype="mixed", optimizer="adamw",
grad_accum=True), summed over those three categories. P is chosen divisible by N, so DeepSpeed's int()
and our per-category rounding agree to the byte.
"""
import functools

import pytest

import labkit as lk
from labkit.estimate import load_config
from labkit.estimate.config import build_model


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
