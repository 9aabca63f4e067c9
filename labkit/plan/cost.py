"""The cost model: seconds per training step (or per batch of served requests) from counted FLOPs and bytes
over stated rates, and the rule that ranks plans. Every constant is printed with the table; none is
measured yet (no record in data/gpu/ holds an MFU or a link bandwidth): the spec-sheet figures of
data/gpus.csv are used, with no overlap of compute, transfers and communication (an upper bound).

    compute      FLOPs / (peak FLOP/s x MFU x GPUs): 6 N per token for a training step (2 forward, 4
                 backward; Kaplan et al. 2020), 4 N with a frozen base (input gradients only), + 2 N with
                 full recomputation; attention's score FLOPs (2 L s a d per token forward, causal) x 3;
                 chunked cross-entropy's recomputed logits (2 V h per token)
    data par.    every micro-batch: ZeRO-3 gathers the weights for forward and again for backward and
                 reduce-scatters the gradients (3 (d-1)/d W; ZeRO sec. 7), ZeRO-2 reduce-scatters the
                 gradients; once per step: DDP and ZeRO-1 all-reduce (2 (d-1)/d G), ZeRO-1/2 gather
                 the updated weights. A frozen base sharded (FSDP of LoRA) gathers twice per micro-batch.
    tensor par.  4 all-reduces of the activations per layer per micro-batch (Megatron-LM sec. 3)
    host links   one direction of PCIe (half the spec sheet's bidirectional figure), every micro-batch:
                 offloaded gradients out and weights in (`offload_bytes`), offloaded activations out and
                 back; once per step: weights back, paged optimizer state out and back; plus the CPU's
                 Adam at CPU_GBPS
    bubble       pipeline: the step x (p - 1) / m for m micro-batches (GPipe, 1F1B)
    serving      a batch of requests of `seq` tokens: the prefill of seq - OUTPUT_TOKENS prompt tokens
                 each (compute-bound: 2 N per token at MFU), then OUTPUT_TOKENS decode steps, each reading
                 the weights and the cache at HBM_UTIL of the bandwidth or computing 2 N per sequence,
                 whichever is slower; tokens/s counts generated tokens

Ranking (`rank_key`): plans that fit first; among those, precision before speed: a plan whose update
has no fp32 master weights (pure bf16: no Kahan summation, no stochastic rounding; notebook 02 measures
the updates it loses) ranks after every plan that keeps fp32 master weights, and for serving, 16-bit
weights and cache before 8-bit, 8-bit before 4-bit; then the fastest; ties (equal to 3 significant
digits) go to the smaller peak, then to fewer levers, then alphabetically by techniques. Plans that do
not fit follow, smallest peak first.
"""
from __future__ import annotations

import math

__all__ = ["MFU", "HBM_UTIL", "CPU_GBPS", "OUTPUT_TOKENS", "train_flops", "attention_flops", "ce_recompute_flops",
           "offload_bytes",
           "offload_seconds", "host_seconds", "link_bps", "data_parallel_bytes", "quality_tier", "rank_key"]

MFU = 0.4            # model FLOP/s utilisation assumed for training and prefill (PaLM, Chowdhery et al. 2022: 46%)
HBM_UTIL = 0.8       # share of the spec sheet's memory bandwidth a decode step reaches (assumed)
CPU_GBPS = 50        # host memory bandwidth for the CPU's Adam update, GB/s (assumed: a server's DDR channels)
OUTPUT_TOKENS = 256  # tokens each served request generates (assumed workload); the rest of seq is its prompt


def train_flops(params, tokens, recompute=False, frozen=False):
    """FLOPs of one training step: 6 N per token (Kaplan et al. 2020, sec. 2.1), 4 N when the weights are
    frozen (LoRA: input gradients only), plus one more forward (2 N) with full recomputation."""
    full = recompute is True or (isinstance(recompute, int) and not isinstance(recompute, bool))
    per = (4 if frozen else 6) + (2 if full else 0)
    return per * params * tokens


def attention_flops(s, seq, tokens, recompute=False):
    """The score FLOPs 6 N leaves out: Q K^T and P V, 2 L s a d per token forward with a causal mask,
    three times that for a training step (four with full recomputation)."""
    passes = 4 if recompute is True else 3
    return passes * 2 * s["L"] * seq * s["a"] * s["d"] * tokens


def ce_recompute_flops(s, tokens, chunked_ce):
    """notebook 12's chunked cross-entropy recomputes the logits in backward: one more LM-head product,
    2 V h per token (torchtune's chunked output loss keeps them and recomputes nothing)."""
    return 2 * s["V"] * s["h"] * tokens if chunked_ce is True else 0


def offload_bytes(weight_bytes, offload, grad_accum=1):
    """Bytes one step moves over PCIe for `weight_bytes` of weights (as many of gradients) on one rank:
    "optimizer" (ZeRO-Offload, Ren et al. 2021, sec. 4.2): every micro-batch's gradients to the host,
    where they are accumulated, and the updated weights back once; "parameters" (ZeRO-Infinity) also
    brings every weight to the device for each micro-batch's forward and again for its backward."""
    if offload not in (None, "optimizer", "parameters"):
        raise ValueError(f"offload must be None, 'optimizer' or 'parameters', got {offload!r}")
    if not offload:
        return 0
    moved = weight_bytes * grad_accum + weight_bytes
    if offload == "parameters":
        moved += 2 * weight_bytes * grad_accum
    return int(moved)


def host_seconds(nbytes, gpu):
    """Seconds to move `nbytes` over one direction of PCIe (half the spec sheet's bidirectional figure)."""
    return nbytes / (gpu["pcie_bps"] / 2)


def offload_seconds(weight_bytes, offload, grad_accum, params, gpu):
    """Seconds of one step spent offloading: offload_bytes over one direction of PCIe plus the CPU's Adam
    update, 16 bytes of state per parameter read and written at CPU_GBPS; no overlap with compute (an
    upper bound: DeepSpeed overlaps part of it)."""
    if not offload:
        return 0.0
    return host_seconds(offload_bytes(weight_bytes, offload, grad_accum), gpu) + 2 * 16 * params / (CPU_GBPS * 1e9)


def link_bps(gpu, gpus):
    """Bytes/s of one direction between GPUs: NVLink where the card has it, else PCIe."""
    return (gpu["nvlink_bps"] or gpu["pcie_bps"]) / 2 if gpus > 1 else float("inf")


def data_parallel_bytes(dp, zero, weight_bytes, grad_bytes, grad_accum):
    """Bytes one rank sends per step for data parallelism over `dp` ranks, micro-batches priced alike:
    ZeRO-3 gathers the weights twice and reduce-scatters the gradients every micro-batch; ZeRO-2
    reduce-scatters every micro-batch and gathers the updated weights once; DDP and ZeRO-1 all-reduce
    once (accumulating locally under no_sync), ZeRO-1 then gathers the updated weights."""
    if dp == 1:
        return 0
    f = (dp - 1) / dp
    if zero == 3:
        return f * (2 * weight_bytes + grad_bytes) * grad_accum
    if zero == 2:
        return f * (grad_bytes * grad_accum + weight_bytes)
    return f * 2 * grad_bytes


def quality_tier(levers, task):
    """0 for what trains or serves the model as published, higher for what changes its numbers: pure
    bf16 updates (no fp32 master weights), served weights or cache below 16 bits (1 for 8-bit, 2 for 4-bit)."""
    if task == "serve":
        return {"bf16": 0, "int8": 1, "nf4": 2}[levers["weights"]] + (levers["kv_dtype"] != "bf16")
    return 1 if levers.get("dtype") == "bf16" else 0


def _sig(x, digits=3):
    """x to `digits` significant digits: times equal to that precision are a tie."""
    if not x or not math.isfinite(x):
        return x
    return round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def rank_key(plan, task):
    """The stated ranking (see the module docstring)."""
    if not plan.fits:
        return (1, 0, 0, plan.peak_bytes, len(plan.techniques), tuple(plan.techniques))
    speed = -_sig(plan.tokens_per_s) if task == "serve" else _sig(plan.step_time_s)
    return (0, quality_tier(plan.levers, task), speed, plan.peak_bytes, len(plan.techniques), tuple(plan.techniques))
