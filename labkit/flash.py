"""A FlashAttention forward kernel in Triton (after Triton's tutorial 06-fused-attention), small and readable.

Each program computes one BLOCK_M-row tile of the output for one (batch, head): it streams K and V in
BLOCK_N-row tiles, keeps a running max `m`, a running sum `l` and an unnormalised accumulator, and
never forms the N x N score matrix (Dao et al. 2022, Algorithm 1, forward only).

Without a GPU, Triton runs kernels on CPU tensors through its interpreter, which it chooses when a
kernel is defined and its language is first imported; this module sets TRITON_INTERPRET=1 before
importing triton when no CUDA device is present, and says so if triton came first (torch's compiler
stack imports it too: set the variable at the top of a notebook, as notebook 08 does). The interpreter computes `tl.dot` wrongly on bf16 inputs, so there the tiles are
upcast to fp32 first (UPCAST). Import this module only where Triton is wanted (`lk.has("triton")`).
"""
from __future__ import annotations

import math
import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError("triton was imported before labkit.flash could choose its CPU interpreter: "
                          "import labkit.flash first, or start Python with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton                      # noqa: E402  (after choosing the interpreter)
import triton.language as tl       # noqa: E402

__all__ = ["flash_attention", "INTERPRETED"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _flash_fwd(Q, K, V, O, scale, N, stride_h, stride_n,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    start_m = tl.program_id(0)                       # which tile of query rows
    head = tl.program_id(1)                          # which (batch * heads) slice
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    base = head * stride_h
    q = tl.load(Q + base + offs_m[:, None] * stride_n + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)        # running max of each row's scores
    l_i = tl.zeros([BLOCK_M], tl.float32)                      # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, D], tl.float32)                   # running sum of exp(score - m_i) @ V
    hi = tl.minimum((start_m + 1) * BLOCK_M, N) if CAUSAL else N
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < N
        k = tl.load(K + base + cols[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + base + cols[:, None] * stride_n + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale                     # (BLOCK_M, BLOCK_N) scores of this tile
        valid = cols[None, :] < N
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= cols[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)                            # rescale what was summed so far
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + base + offs_m[:, None] * stride_n + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=offs_m[:, None] < N)


def flash_attention(q, k, v, causal=False, block_m=32, block_n=32):
    """softmax(q k^T / sqrt(d)) v for (batch, heads, N, d) tensors, by the tiled Triton kernel."""
    if not (q.shape == k.shape == v.shape and q.dim() == 4):
        raise ValueError(f"q, k, v must share one (batch, heads, N, d) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, N, D = q.shape
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head dim must be 16, 32, 64 or 128 (a power of two tl.dot accepts), got {D}")
    q, k, v = (t.contiguous().view(B * H, N, D) for t in (q, k, v))
    out = torch.empty_like(q)
    grid = (triton.cdiv(N, block_m), B * H)
    _flash_fwd[grid](q, k, v, out, 1.0 / math.sqrt(D), N, q.stride(0), q.stride(1), D=D, BLOCK_M=block_m,
                     BLOCK_N=block_n, CAUSAL=causal, UPCAST=INTERPRETED and q.dtype != torch.float32)
    return out.view(B, H, N, D)
