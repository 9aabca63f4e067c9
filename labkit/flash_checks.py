"""Every argument of `labkit.flash`, checked before any work: one function per public entry point, each error
naming the argument and its value. `labkit.flash` holds the algorithms; this module holds their rules:
the kernels' tiles are powers of two of at least 16 (tl.dot's smallest), head dims 16 to 128, fp32, fp16 or
bf16 inputs on one device, Hq a multiple of Hkv, and no meta tensors (attention needs values).
"""
from __future__ import annotations

import math
import numbers

import torch

from .checks import count, flag, power_of_two

__all__ = ["check_attention", "check_decode", "check_paged", "check_io", "HEAD_DIMS", "DTYPES"]

HEAD_DIMS = (16, 32, 64, 128)      # powers of two that tl.arange and tl.dot accept
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = " (tl.dot's smallest tile)"


def check_attention(q, k, v, causal, sm_scale, **blocks):
    """flash_attention's arguments (and flash_decode's, which shares them); returns the softmax scale.
    blocks: the tile sizes by name (block_m=..., block_n=...)."""
    if isinstance(k, torch.Tensor) and k.dim() == 4 and k.shape[2] == 0:
        raise ValueError(f"k holds no keys (shape {tuple(k.shape)}): a softmax over no keys is undefined "
                         f"(SDPA returns zeros there, a kernel 0/0); pass at least one key")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _tensor(name, t, 4, "(batch, heads, N, d)")
    _dtypes(q=q, k=k, v=v)
    (B, Hq, Nq, D), (Bk, Hkv, Nk, Dk) = q.shape, k.shape
    if k.shape != v.shape or Bk != B:
        raise ValueError(f"k and v must be (batch, kv_heads, Nk, d) with q's batch and d: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    _heads(Hq, Hkv, D, Dk)
    if flag("causal", causal) and Nq > Nk:
        raise ValueError(f"causal attention aligned bottom-right needs Nq <= Nk (rows above would see no key), "
                         f"got Nq={Nq}, Nk={Nk}")
    for name, b in blocks.items():
        power_of_two(name, b, 16, TILE)
    return _scale(sm_scale, D)


def check_decode(q, k, v, num_splits, sm_scale, block_n):
    """flash_decode's arguments: attention's, one query per head, a positive number of splits; returns the scale."""
    scale = check_attention(q, k, v, False, sm_scale, block_n=block_n)
    if q.shape[2] != 1:
        raise ValueError(f"flash_decode takes one query per head (q of shape (batch, heads, 1, d)), got Nq={q.shape[2]}")
    count("num_splits", num_splits)
    return scale


def check_paged(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    """paged_attention's arguments, the block table's entries included (each within the cache); returns the scale."""
    _tensor("q", q, 3, "(batch, heads, d)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, 4, "(num_blocks, block_size, kv_heads, d)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must share one shape, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    _dtypes(q=q, k_cache=k_cache, v_cache=v_cache)
    B, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    _heads(Hq, Hkv, D, Dk)
    scale = _scale(sm_scale, D)
    power_of_two("block_size", block_size, why=" (tl.arange's rule)")
    for name, t, shape in (("block_table", block_table, f"(batch={B}, max_blocks)"), ("seq_lens", seq_lens, f"({B},)")):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an int tensor {shape}, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (a shape without values): the kernel reads its values")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be an int (batch={B}, max_blocks) tensor, got {tuple(block_table.shape)}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be an int ({B},) tensor, got {tuple(seq_lens.shape)}")
    lens = seq_lens.tolist()
    if min(lens) < 1 or max(lens) > block_table.shape[1] * block_size:
        raise ValueError(f"seq_lens must lie in [1, max_blocks * block_size = {block_table.shape[1] * block_size}], got {lens}")
    used = torch.cat([block_table[b, :-(-n // block_size)] for b, n in enumerate(lens)])
    if used.min() < 0 or used.max() >= num_blocks:
        raise ValueError(f"block_table points outside the cache's {num_blocks} blocks: {used.tolist()}")
    return scale


def check_io(q, k, v, sram=None):
    """The IO algorithms' one head: q, k, v non-empty (N, d) of one shape (meta tensors welcome: the bytes need
    only shapes); `sram`, where given, elements with d <= sram <= N d (Algorithm 1's precondition)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or 0 in t.shape:
            raise ValueError(f"{name} must be a non-empty (N, d) tensor, one head, got {getattr(t, 'shape', t)!r}")
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k, v must share one (N, d) shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    N, d = q.shape
    if sram is not None and not d <= count("sram", sram) <= N * d:
        raise ValueError(f"sram must be a number of elements with d <= sram <= N d ({d} .. {N * d}), got {sram!r}")


def _tensor(name, t, dims, what):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (a shape without values): attention needs real values")
    if t.dim() != dims:
        raise ValueError(f"{name} must be a {what} tensor, got shape {tuple(t.shape)}")
    if any(n == 0 for n in t.shape):
        raise ValueError(f"{name} must not be empty ({what}), got shape {tuple(t.shape)}")


def _dtypes(**tensors):
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if len({t.dtype for t in tensors.values()}) > 1:
        raise TypeError(f"{', '.join(tensors)} must share a dtype, got "
                        + ", ".join(f"{n} {t.dtype}" for n, t in tensors.items()))
    if len({t.device for t in tensors.values()}) > 1:
        raise ValueError("all tensors must be on one device, got " + ", ".join(f"{n} {t.device}" for n, t in tensors.items()))


def _heads(hq, hkv, d, dk):
    if dk != d or d not in HEAD_DIMS:
        raise ValueError(f"head dim must be 16, 32, 64 or 128 (a power of two tl.dot accepts) and equal in q "
                         f"and k, got {d} and {dk}")
    if hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of k's and v's heads ({hkv}) for grouped-query attention")


def _scale(sm_scale, d):
    if sm_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a finite number or None (1/sqrt(d)), got {sm_scale!r}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite number or None (1/sqrt(d)), got {sm_scale!r}")
    return float(sm_scale)
