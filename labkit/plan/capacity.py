"""What a plan must fit into: the card as the driver reports it less the CUDA context, the caching
allocator's share modelled from its rules, and the host's memory for whatever a plan offloads.

    card         nvidia-smi's total (data/gpus.csv memory_mib, each with where the figure was read): a
                 "24 GB" RTX 4090 holds 24,564 MiB = 23.99 GiB, not 24e9 B
    context      CUDA_CONTEXT, taken off every card: the driver's context and the kernels a step loads
    allocator    what PyTorch's caching allocator needs beyond the live bytes, from its own rules:
                 `state_rounding` (each long-lived tensor's block rounded, labkit.alloc's round_size and
                 allocation_size) plus `step_fragmentation` (labkit.alloc replaying the allocation trace
                 of a two-layer step of the same width on fake tensors: the smallest device that runs it,
                 less its live peak), not a flat share of the peak
    host         host_memory (default `default_host_memory`): what an offload plan puts there, with
                 DeepSpeed's buffer factor on offloaded model states
"""
from __future__ import annotations

import csv
import functools
import json

from ..data import DATA_DIR as DATA
from ..units import GiB, MiB, fmt_bytes, parse_bytes

__all__ = ["CUDA_CONTEXT", "HOST_BUFFER", "HOST_MIN", "HOST_PER_GPU_MEMORY", "gpu_names", "gpu_spec",
           "default_host_memory", "host_bytes", "state_rounding", "step_fragmentation", "allocator_overhead"]

# The CUDA context: "~300MB ... Starting with 11.7 CUDA implemented lazy kernel/module loading" (ptrblck,
# https://github.com/pytorch/pytorch/issues/107667); a training step then loads its kernels (cuBLAS,
# the fused optimizer, attention) into it: 500 MiB in all (assumed for the loaded kernels; no GPU record
# in data/gpu/ measures it yet).
CUDA_CONTEXT = 500 * MiB
# Host memory per byte offloaded: DeepSpeed's estimators multiply the offloaded model states by
# additional_buffer_factor=1.5 (deepspeed/runtime/zero/stage3.py, estimate_zero3_model_states_mem_needs:
# cpu_mem = total_params * 18 * ... * additional_buffer_factor): pinned staging buffers and fragmentation.
HOST_BUFFER = 1.5
# Default host memory when none is given: twice the node's GPU memory, at least 64 GiB (assumed: cloud
# GPU nodes carry one to four times their GPU memory in DRAM; pass host_memory= for yours).
HOST_PER_GPU_MEMORY, HOST_MIN = 2, 64 * GiB


@functools.lru_cache(maxsize=1)
def _gpu_table():
    with open(DATA / "gpus.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for r in rows:
        out[r["name"].lower()] = dict(
            name=r["name"], memory=int(r["memory_mib"]) * MiB, memory_source=r["memory_source"],
            bf16_flops=float(r["bf16_tflops"]) * 1e12, fp32_flops=float(r["fp32_tflops"]) * 1e12,
            hbm_bps=float(r["hbm_gbps"]) * 1e9, pcie_bps=float(r["pcie_gbps"]) * 1e9,
            nvlink_bps=float(r["nvlink_gbps"]) * 1e9, source=r["source"], measured=False)
    return out


def gpu_names():
    """The GPUs of data/gpus.csv, as `plan` accepts them."""
    return [g["name"] for g in _gpu_table().values()]


def gpu_spec(gpu):
    """A GPU's figures: a name of data/gpus.csv (any case) or a memory size (bytes or "24 GiB": the
    driver's total; its compute and links are then the A100 80GB's, as the returned "name" says).
    "memory" is the driver's total, "usable" that less CUDA_CONTEXT."""
    table = _gpu_table()
    if isinstance(gpu, dict):
        return dict(gpu)
    key = gpu.strip().lower() if isinstance(gpu, str) else None
    if key in table:
        g = dict(table[key])
    elif key is not None and (key.replace(".", "", 1).isdigit() or any(key in k for k in table)):
        near = [g["name"] for k, g in table.items() if key in k]     # "A100", "4090"; a bare "3090" has no unit
        raise ValueError(f"gpu {gpu!r} is not a GPU of data/gpus.csv" + (f" (did you mean {' or '.join(near)}?)"
                         if near else "") + f"; they are {gpu_names()}, or give the memory with a unit, like '24 GiB'")
    else:
        try:
            memory = parse_bytes(gpu, "gpu")
        except (TypeError, ValueError):
            raise ValueError(f"gpu must be one of {gpu_names()} or a memory size like '24 GiB', got {gpu!r}") from None
        if memory <= CUDA_CONTEXT:
            raise ValueError(f"gpu {gpu!r}: {fmt_bytes(memory)} does not hold the CUDA context "
                             f"({fmt_bytes(CUDA_CONTEXT)})")
        g = dict(table["a100 80gb"], name=f"{fmt_bytes(memory)} (A100 80GB's compute)", memory=memory,
                 memory_source="given")
    g["usable"] = g["memory"] - CUDA_CONTEXT
    return g


def default_host_memory(gpu, gpus):
    """HOST_PER_GPU_MEMORY x the node's GPU memory, at least HOST_MIN (a stated assumption)."""
    return max(HOST_MIN, HOST_PER_GPU_MEMORY * gpus * gpu_spec(gpu)["memory"])


def host_bytes(host, ranks=1):
    """Host memory a plan needs for `host` (bytes per category that one rank put there) on `ranks` ranks of
    one node: offloaded model states times HOST_BUFFER (DeepSpeed's buffer factor), activations and paged
    optimizer state as they are (pinned copies)."""
    states = sum(v for k, v in host.items() if k in ("parameters", "gradients", "optimizer", "other"))
    return int(ranks * (HOST_BUFFER * states + host.get("activations", 0) + host.get("paged", 0)))


def state_rounding(numels, bytes_per_element):
    """Bytes the caching allocator adds to long-lived tensors of `numels` elements (weights, gradients,
    optimizer state, allocated once each): the block rounded to 512 B (round_size), and a large segment's
    tail (allocation_size rounds it to 2 MiB) that the allocator cannot split off (a remainder of at most
    1 MiB stays with the block: CUDACachingAllocator.cpp should_split). labkit.alloc holds the rules."""
    from ..alloc import allocation_size, round_size
    waste = 0
    for n in set(numels):
        size = int(n * bytes_per_element)
        if size <= 0:
            continue
        block = round_size(size)
        tail = allocation_size(block) - block
        waste += numels.count(n) * (block - size + (tail if block > MiB and tail <= MiB else 0))
    return waste


@functools.lru_cache(maxsize=64)
def _replayed(config_json, batch, seq, training, layers):
    """(live peak, smallest device, peak reserved) of a `layers`-deep bf16 step of this width, traced on
    fake tensors by lk.track and replayed through labkit.alloc."""
    import torch
    from .. import alloc
    from ..estimate.config import build_model
    from ..estimate.step import quiet
    from ..memory import track
    from transformers import AutoConfig
    data = json.loads(config_json)
    # per-layer lists (Qwen2's layer_types, ...) follow the depth: transformers refuses a length that differs
    for key, value in list(data.items()):
        if isinstance(value, list) and len(value) == data.get("num_hidden_layers"):
            data[key] = value[:layers]
    data.update(num_hidden_layers=layers)
    cfg = AutoConfig.for_model(**data)
    model = build_model(cfg, "fake", torch.bfloat16)
    with quiet(), model.fake_mode:
        ids = torch.zeros(batch, seq, dtype=torch.long)
        if training:
            model.train()
            with track(model) as mem:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                del loss
        else:
            model.eval()
            with torch.no_grad(), track(model) as mem:
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                del out
    trace = mem.trace
    return mem.peak, alloc.smallest_device(trace), alloc.replay(trace).peak_reserved


def step_fragmentation(config, batch, seq, training=True, layers=2):
    """{"fit": bytes, "reserved": bytes} the caching allocator needs beyond a step's live peak: labkit.alloc
    replays the allocation trace of this model's step at `layers` layers (same width, micro-batch and
    sequence, bf16, on fake tensors); "fit" is the smallest device that runs the trace less its live peak
    (what decides an out-of-memory: the allocator frees its cache and retries first), "reserved" what it
    holds at its peak with memory to spare (torch.cuda.max_memory_reserved). Each layer repeats the same
    pattern of blocks, so the excess does not grow with depth (tests/test_plan.py: 2 layers against 4)."""
    from ..estimate import load_config
    cfg = load_config(config)
    keep = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_") and k not in ("architectures",)}
    keep["attn_implementation"] = "sdpa"
    live, fit, reserved = _replayed(json.dumps(keep, sort_keys=True, default=str), int(batch), int(seq),
                                    bool(training), int(layers))
    return {"fit": max(0, fit - live), "reserved": max(0, reserved - live)}


def allocator_overhead(numels, state_bytes_per_element, fragmentation):
    """The allocator's share of one plan: `state_rounding` of its long-lived tensors plus the step's
    `fragmentation` (step_fragmentation's "fit" or "reserved")."""
    return state_rounding(numels, state_bytes_per_element) + fragmentation
