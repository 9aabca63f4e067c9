"""FlashAttention in Triton, forward and backward, plus the two decoding kernels, small and readable.

After Triton's tutorial 06-fused-attention and Dao 2023 (FlashAttention-2, Algorithms 1 and 2):

- forward (`_flash_fwd`): one program per BLOCK_M query rows of one (batch, head); it streams K and V in
  BLOCK_N-row tiles with a running max `m`, sum `l` and an fp32 accumulator, never forming the N x N
  scores, and saves O and each row's log-sum-exp `lse = m + log(l)` (4 bytes a row) for backward;
- backward: P is recomputed tile by tile from the saved `lse` (`P = exp(S - lse)`), with
  `D = rowsum(dO * O)` (so `dS = P * (dP - D)`); `_flash_bwd_dkdv` owns a tile of keys and loops over
  queries, `_flash_bwd_dq` owns a tile of queries and loops over keys. `flash_attention` wraps both in a
  `torch.autograd.Function`, so autograd holds only O and the log-sum-exp between the two passes;
- grouped-query / multi-query attention: K and V may have fewer heads than Q (`Hq % Hkv == 0`), query
  head `h` reads key/value head `h // (Hq // Hkv)`, as in Llama-3;
- Nq != Nk with the causal mask aligned bottom-right (query i sees keys j <= i + Nk - Nq), the
  convention of flash-attn >= 2.1 for decoding and chunked prefill (SDPA's `is_causal` aligns top-left);
- decoding: `flash_decode` splits one query's keys over programs and combines the partial results through
  their log-sum-exps (flash-decoding, Dao et al. 2023 blog); `paged_attention` reads K/V through a block
  table (vLLM's PagedAttention, Kwon et al. 2023), the tables of notebook 07.

Every kernel accumulates in fp32 whatever its inputs are.

Without a GPU, Triton runs kernels on CPU tensors through its interpreter, which it chooses when a
kernel is defined and its language is first imported; this module sets TRITON_INTERPRET=1 before
importing triton when no CUDA device is present, and says so if triton came first (torch's compiler
stack imports it too: set the variable at the top of a notebook, as notebook 08 does). The interpreter
computes `tl.dot` wrongly on bf16 inputs, so there the tiles are upcast to fp32 first (UPCAST), and it
truncates fp32 to bf16 instead of rounding to nearest, so there the kernels write fp32 and torch rounds
(`_result`). Import this module only where Triton is wanted (`lk.has("triton")`).
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

__all__ = ["flash_attention", "flash_decode", "combine_splits", "paged_attention", "INTERPRETED"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HEAD_DIMS = (16, 32, 64, 128)      # powers of two that tl.arange and tl.dot accept


# ---------------------------------------------------------------- forward
@triton.jit
def _flash_fwd(Q, K, V, O, LSE, scale, Nq, Nk, Hq, GROUP,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    start_m = tl.program_id(0)                       # which tile of query rows
    bh = tl.program_id(1)                            # which (batch, query head)
    kv_bh = (bh // Hq) * (Hq // GROUP) + (bh % Hq) // GROUP     # its (batch, key/value head)
    q_base, kv_base = bh * Nq * D, kv_bh * Nk * D    # contiguous (B, H, N, D) tensors
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + q_base + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < Nq, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)        # running max of each row's scores
    l_i = tl.zeros([BLOCK_M], tl.float32)                      # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, D], tl.float32)                   # running sum of exp(score - m_i) @ V
    shift = Nk - Nq                                            # bottom-right causal: row i sees j <= i + shift
    hi = tl.minimum((start_m + 1) * BLOCK_M + shift, Nk) if CAUSAL else Nk
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < Nk
        k = tl.load(K + kv_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale                     # (BLOCK_M, BLOCK_N) scores of this tile
        valid = cols[None, :] < Nk
        if CAUSAL:
            valid = valid & (offs_m[:, None] + shift >= cols[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)                            # rescale what was summed so far
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    rows = offs_m < Nq
    tl.store(O + q_base + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=rows[:, None])
    tl.store(LSE + bh * Nq + offs_m, m_i + tl.log(l_i), mask=rows)   # all backward needs of P


# ---------------------------------------------------------------- backward
@triton.jit
def _p_and_ds(q, k, v, do, lse, delta, rows, cols, Nq, Nk, scale, CAUSAL: tl.constexpr):
    """One (queries x keys) tile of the backward, shared by both kernels: P recomputed from the saved
    log-sum-exp (never stored), and dS = P * (dP - D) with dP = dO V^T and D = rowsum(dO * O)."""
    s = tl.dot(q, tl.trans(k)) * scale                         # (BLOCK_M, BLOCK_N), as in forward
    valid = (rows[:, None] < Nq) & (cols[None, :] < Nk)
    if CAUSAL:                                                 # bottom-right aligned, as in forward
        valid = valid & (rows[:, None] + Nk - Nq >= cols[None, :])
    p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v)).to(tl.float32)
    return p, p * (dp - delta[:, None])


@triton.jit
def _flash_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, scale, Nq, Nk, Hq, GROUP,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """dV = P^T dO and dK = scale * dS^T Q for one tile of keys, summed over every query (and, with GQA,
    over the GROUP query heads that share this key/value head)."""
    start_n = tl.program_id(0)
    kv_bh = tl.program_id(1)                                   # which (batch, key/value head)
    Hkv = Hq // GROUP
    kv_base = kv_bh * Nk * D
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    kv_mask = offs_n[:, None] < Nk
    k = tl.load(K + kv_base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + kv_base + offs_n[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    shift = Nk - Nq
    lo = 0
    if CAUSAL:                                                 # earlier queries never see these keys
        lo = tl.maximum(start_n * BLOCK_N - shift, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        bh = (kv_bh // Hkv) * Hq + (kv_bh % Hkv) * GROUP + g   # a query head reading this K/V head
        q_base = bh * Nq * D
        for start_m in range(lo, Nq, BLOCK_M):
            rows = start_m + offs_m
            row_mask = rows[:, None] < Nq
            q = tl.load(Q + q_base + rows[:, None] * D + offs_d[None, :], mask=row_mask, other=0.0)
            do = tl.load(DO + q_base + rows[:, None] * D + offs_d[None, :], mask=row_mask, other=0.0)
            if UPCAST:
                q, do = q.to(tl.float32), do.to(tl.float32)
            lse = tl.load(LSE + bh * Nq + rows, mask=rows < Nq, other=0.0)
            delta = tl.load(DELTA + bh * Nq + rows, mask=rows < Nq, other=0.0)
            p, ds = _p_and_ds(q, k, v, do, lse, delta, rows, offs_n, Nq, Nk, scale, CAUSAL)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do).to(tl.float32)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q).to(tl.float32)
    tl.store(DK + kv_base + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flash_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, scale, Nq, Nk, Hq, GROUP,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """dQ = scale * dS K for one tile of queries, over every key."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    kv_bh = (bh // Hq) * (Hq // GROUP) + (bh % Hq) // GROUP
    q_base, kv_base = bh * Nq * D, kv_bh * Nk * D
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_mask = offs_m[:, None] < Nq
    q = tl.load(Q + q_base + offs_m[:, None] * D + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(DO + q_base + offs_m[:, None] * D + offs_d[None, :], mask=row_mask, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(LSE + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
    delta = tl.load(DELTA + bh * Nq + offs_m, mask=offs_m < Nq, other=0.0)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    shift = Nk - Nq
    hi = tl.minimum((start_m + 1) * BLOCK_M + shift, Nk) if CAUSAL else Nk
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = cols[:, None] < Nk
        k = tl.load(K + kv_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + kv_base + cols[:, None] * D + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        _, ds = _p_and_ds(q, k, v, do, lse, delta, offs_m, cols, Nq, Nk, scale, CAUSAL)
        dq += tl.dot(ds.to(k.dtype), k).to(tl.float32)
    tl.store(DQ + q_base + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_mask)


# ---------------------------------------------------------------- the Python side
def _check_qkv(q, k, v, causal):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a (batch, heads, N, d) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    (B, Hq, Nq, D), (Bk, Hkv, Nk, Dk) = q.shape, k.shape
    if k.shape != v.shape or Bk != B or Dk != D:
        raise ValueError(f"k and v must be (batch, kv_heads, Nk, d) with q's batch and d: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hq % Hkv:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of k's and v's heads ({Hkv}) for grouped-query attention")
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim must be 16, 32, 64 or 128 (a power of two tl.dot accepts), got {D}")
    if causal and Nq > Nk:
        raise ValueError(f"causal attention aligned bottom-right needs Nq <= Nk (rows above would see no key), "
                         f"got Nq={Nq}, Nk={Nk}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _result_buffer(like):
    """Where a kernel writes a result shaped like `like`: fp32 under the interpreter (see `_result`)."""
    return torch.empty_like(like, dtype=torch.float32 if INTERPRETED else like.dtype)


def _result(buffer, dtype):
    """The kernel's result in `dtype`, rounded to nearest by torch (the interpreter would truncate)."""
    return buffer.to(dtype)


def _launch_args(q, k, causal, sm_scale, block_m, block_n):
    B, Hq, Nq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    consts = dict(D=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
                  UPCAST=INTERPRETED and q.dtype != torch.float32)
    return (scale, Nq, k.shape[2], Hq, group), consts


class _FlashAttention(torch.autograd.Function):
    """Forward saves (q, k, v, O, lse): q, k, v are the caller's own tensors (when contiguous), so
    autograd's extra holding between the passes is O and the fp32 log-sum-exp, B * H * Nq * (d * itemsize + 4) bytes."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, block_m, block_n):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, Hq, Nq, D = q.shape
        o = _result_buffer(q)
        lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)
        args, consts = _launch_args(q, k, causal, sm_scale, block_m, block_n)
        _flash_fwd[(triton.cdiv(Nq, block_m), B * Hq)](q, k, v, o, lse, *args, **consts)
        o = _result(o, q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.settings = (causal, sm_scale, block_m, block_n)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, sm_scale, block_m, block_n = ctx.settings
        do = do.contiguous()
        delta = (do.float() * o.float()).sum(-1)               # D = rowsum(dO * O), (B, Hq, Nq) fp32
        dq, dk, dv = _result_buffer(q), _result_buffer(k), _result_buffer(v)
        args, consts = _launch_args(q, k, causal, sm_scale, block_m, block_n)
        B, Hkv, Nk, _ = k.shape
        _flash_bwd_dkdv[(triton.cdiv(Nk, block_n), B * Hkv)](q, k, v, do, lse, delta, dk, dv, *args, **consts)
        _flash_bwd_dq[(triton.cdiv(q.shape[2], block_m), B * q.shape[1])](q, k, v, do, lse, delta, dq, *args, **consts)
        return _result(dq, q.dtype), _result(dk, k.dtype), _result(dv, v.dtype), None, None, None, None


def flash_attention(q, k, v, causal=False, sm_scale=None, block_m=32, block_n=32, return_lse=False):
    """softmax(q k^T * sm_scale) v by the tiled Triton kernels, with a Triton backward for autograd.

    q: (batch, Hq, Nq, d); k, v: (batch, Hkv, Nk, d) with Hq a multiple of Hkv (GQA/MQA). `causal`
    aligns the mask bottom-right (query i sees keys j <= i + Nk - Nq). `sm_scale` defaults to 1/sqrt(d).
    With `return_lse`, also the (batch, Hq, Nq) fp32 log-sum-exp of each row's scores.
    """
    _check_qkv(q, k, v, causal)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {b!r}")
    o, lse = _FlashAttention.apply(q, k, v, causal, sm_scale, block_m, block_n)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------- decoding: one query, a long cache
@triton.jit
def _decode_split(Q, K, V, O_PART, LSE_PART, scale, Nk, Hq, GROUP, SPLITS, split_len,
                  D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One query row against keys [split * split_len, (split + 1) * split_len): its partial output
    (normalised within the split) and the split's log-sum-exp."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    kv_bh = (bh // Hq) * (Hq // GROUP) + (bh % Hq) // GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + bh * D + offs_d).to(tl.float32) * scale    # (D,): one row, so no tl.dot
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, Nk)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        mask = cols < end
        ptrs = kv_bh * Nk * D + cols[:, None] * D + offs_d[None, :]
        k = tl.load(K + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
        v = tl.load(V + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
        s = tl.where(mask, tl.sum(k * q[None, :], 1), float("-inf"))    # (BLOCK_N,) scores
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(O_PART + (bh * SPLITS + split) * D + offs_d, acc / l_i)
    tl.store(LSE_PART + bh * SPLITS + split, m_i + tl.log(l_i))


def combine_splits(o_parts, lse_parts):
    """Merge partial attention results over disjoint key sets: o_parts (..., S, d), lse_parts (..., S).

    With L = logsumexp_s(lse_s), each split's weight is exp(lse_s - L), the share of the softmax's
    denominator its keys hold: O = sum_s exp(lse_s - L) * O_s. Returns (O (..., d), L (...))."""
    lse = torch.logsumexp(lse_parts, dim=-1)
    weights = torch.exp(lse_parts - lse[..., None])            # (..., S), sums to 1
    return (weights[..., None] * o_parts).sum(-2), lse


def flash_decode(q, k, v, num_splits=4, sm_scale=None, block_n=32, return_parts=False):
    """Attention of one new query per (batch, head) against a long K/V cache, split over key blocks.

    q: (batch, Hq, 1, d); k, v: (batch, Hkv, Nk, d). Each of `num_splits` programs per head reads its
    share of the cache (flash-decoding: parallel over the keys, where one query row leaves a forward
    kernel one program per head); `combine_splits` merges them. Returns (batch, Hq, 1, d) in q's dtype,
    or with `return_parts` the fp32 partials (o_parts (B, Hq, S, d), lse_parts (B, Hq, S)) as well.
    """
    _check_qkv(q, k, v, causal=False)
    if q.shape[2] != 1:
        raise ValueError(f"flash_decode takes one query per head (q of shape (batch, heads, 1, d)), got Nq={q.shape[2]}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    B, Hq, _, D = q.shape
    Nk = k.shape[2]
    split_len = triton.cdiv(triton.cdiv(Nk, num_splits), block_n) * block_n     # whole key blocks per split
    splits = triton.cdiv(Nk, split_len)                                         # none left empty
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o_parts = torch.empty(B, Hq, splits, D, device=q.device, dtype=torch.float32)
    lse_parts = torch.empty(B, Hq, splits, device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    _decode_split[(splits, B * Hq)](q, k, v, o_parts, lse_parts, scale, Nk, Hq, Hq // k.shape[1], splits,
                                    split_len, D=D, BLOCK_N=block_n)
    o, _ = combine_splits(o_parts, lse_parts)
    o = o[:, :, None, :].to(q.dtype)
    return (o, o_parts, lse_parts) if return_parts else o


# ---------------------------------------------------------------- decoding through block tables
@triton.jit
def _paged_decode(Q, K_CACHE, V_CACHE, TABLE, SEQ_LENS, O, scale, Hq, GROUP, max_blocks,
                  stride_blk, stride_tok, stride_head,
                  D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One query row of sequence b against its cache, block by block through its block table."""
    bh = tl.program_id(0)
    b = bh // Hq
    kv_head = (bh % Hq) // GROUP
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, D)
    seq_len = tl.load(SEQ_LENS + b)
    q = tl.load(Q + bh * D + offs_d).to(tl.float32) * scale
    m_i = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(TABLE + b * max_blocks + i).to(tl.int64)           # logical block i -> physical
        mask = i * BLOCK_SIZE + offs_t < seq_len                           # the last block may be part-full
        ptrs = block * stride_blk + offs_t[:, None] * stride_tok + kv_head * stride_head + offs_d[None, :]
        k = tl.load(K_CACHE + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
        v = tl.load(V_CACHE + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
        s = tl.where(mask, tl.sum(k * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(O + bh * D + offs_d, (acc / l_i).to(O.dtype.element_ty))


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale=None):
    """Decode attention with K/V stored in fixed-size blocks (PagedAttention).

    q: (batch, Hq, d), one new query per sequence; k_cache, v_cache: (num_blocks, block_size, Hkv, d);
    block_table: (batch, max_blocks) int, physical block of each sequence's logical block i (entries
    past a sequence's length are ignored); seq_lens: (batch,) int, tokens cached per sequence (>= 1).
    Returns (batch, Hq, d) in q's dtype.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (batch, heads, d), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must share one (num_blocks, block_size, kv_heads, d) shape, got "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, Hq, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or D not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS} and equal in q and the cache, got {D} and {Dk}")
    if Hq % Hkv:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of the cache's heads ({Hkv})")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two (tl.arange's rule), got {block_size}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype.is_floating_point:
        raise ValueError(f"block_table must be an int (batch={B}, max_blocks) tensor, got {tuple(block_table.shape)} "
                         f"{block_table.dtype}")
    if seq_lens.shape != (B,) or seq_lens.dtype.is_floating_point:
        raise ValueError(f"seq_lens must be an int ({B},) tensor, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    lens = seq_lens.tolist()
    if min(lens) < 1 or max(lens) > block_table.shape[1] * block_size:
        raise ValueError(f"seq_lens must lie in [1, max_blocks * block_size = {block_table.shape[1] * block_size}], got {lens}")
    used = torch.cat([block_table[b, :triton.cdiv(n, block_size)] for b, n in enumerate(lens)])
    if used.min() < 0 or used.max() >= num_blocks:
        raise ValueError(f"block_table points outside the cache's {num_blocks} blocks: {used.tolist()}")
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    q = q.contiguous()
    o = _result_buffer(q)
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    table, lens_t = block_table.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    _paged_decode[(B * Hq,)](q, k_cache, v_cache, table, lens_t, o, scale, Hq, Hq // Hkv, table.shape[1],
                             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D=D, BLOCK_SIZE=block_size)
    return _result(o, q.dtype)
