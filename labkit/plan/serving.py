"""Serving: the paged KV cache of every concurrent sequence beside the weights, and what a card holds for the
cache as vLLM sizes it. Prefill and decode are priced in labkit.plan.cost's terms by the search."""
from __future__ import annotations

from .adapters import quantized_weight_bytes
from .capacity import gpu_spec

__all__ = ["BLOCK_SIZE", "VLLM_UTILIZATION", "paged_kv_tokens", "kv_bytes", "kv_capacity_tokens"]

BLOCK_SIZE = 16            # vLLM's default block of token slots (Kwon et al. 2023, sec. 7.2)
VLLM_UTILIZATION = 0.9     # vLLM's default gpu_memory_utilization


def paged_kv_tokens(tokens, block_size=BLOCK_SIZE):
    """Token slots a paged KV cache holds for one sequence of `tokens`: whole blocks (vLLM, Kwon et al. 2023,
    sec. 4.2: the waste is under one block per sequence)."""
    return -(-tokens // block_size) * block_size


def kv_bytes(config, sequences, tokens, kv_dtype="bf16", block_size=BLOCK_SIZE):
    """KV cache of `sequences` paged sequences of `tokens`: labkit.estimate's formula in 16 bits, halved for
    an 8-bit cache (vLLM's fp8 KV cache; its per-tensor scales left out)."""
    from ..estimate import kv_cache_bytes
    per = {"bf16": 1.0, "int8": 0.5}
    if kv_dtype not in per:
        raise ValueError(f"kv_dtype must be one of {tuple(per)}, got {kv_dtype!r}")
    return int(kv_cache_bytes(config, sequences, paged_kv_tokens(tokens, block_size), "bf16") * per[kv_dtype])


def kv_capacity_tokens(config, gpu, tp=1, utilization=VLLM_UTILIZATION, weights="bf16", profile_tokens=4096):
    """Token slots of KV cache one replica of `tp` GPUs holds, as vLLM sizes it (its memory profiling,
    vllm/worker/worker.py determine_num_available_blocks): `utilization` of the card as the driver reports
    it, less the weights and the activations of a profiled forward of `profile_tokens` tokens (vLLM's
    max_num_batched_tokens), divided by the cache's bytes per token on one rank; rounded down to whole
    blocks of BLOCK_SIZE."""
    from ..estimate import estimate, kv_cache_bytes, load_config
    cfg = load_config(config)
    g = gpu_spec(gpu)
    prefill = estimate(cfg, batch=1, seq=min(profile_tokens, cfg.max_position_embeddings), dtype="bf16",
                       training=False, method="formula", tp=tp, logits_to_keep=1)
    free = g["memory"] * utilization - quantized_weight_bytes(cfg, weights) / tp - prefill.peak_parts["activations"]
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    per_token = kv_cache_bytes(cfg, 1, 1, "bf16") * max(1, kv // tp) / kv
    return max(0, int(free // per_token) // BLOCK_SIZE * BLOCK_SIZE)
