"""The Triton kernels behind `labkit.flash` (its `backend="triton"`): imported only when they are asked for.

`labkit.flash` validates every argument (`labkit.flash_checks`), holds the plain PyTorch twin of each
algorithm and calls the four functions at the end of this file; tests/test_flash.py checks their results
against the twins.
After Triton's tutorial 06-fused-attention and Dao 2023 (FlashAttention-2, Algorithms 1 and 2).

Without a GPU, Triton runs kernels on CPU tensors through its interpreter, which it chooses when a
kernel is defined and its language is first imported; this module sets TRITON_INTERPRET=1 before
importing triton when no CUDA device is present, and says so if triton came first (torch's compiler
stack imports it too: set the variable at the top of a notebook, as notebook 08 does). The interpreter
computes `tl.dot` wrongly on bf16 inputs, so there the tiles are upcast to fp32 first (UPCAST), and it
truncates fp32 to bf16 instead of rounding to nearest, so there the kernels write fp32 and torch rounds
(`_result`). fp32 inputs are multiplied in IEEE fp32 (`input_precision="ieee"`): Triton's default on
NVIDIA GPUs is TF32 (a 10-bit mantissa), which would put errors of ~1e-3 between kernel and twin.
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError("triton was imported before labkit.flash could choose its CPU interpreter: "
                          "import labkit.flash's Triton backend first, or start Python with TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton                      # noqa: E402  (after choosing the interpreter)
import triton.language as tl       # noqa: E402

__all__ = ["online_softmax", "load_kv_tile", "load_q_tile", "flash_fwd_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel",
           "decode_split_kernel", "paged_decode_kernel", "forward_triton", "backward_triton", "decode_triton",
           "paged_triton", "INTERPRETED"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------- the online softmax, written once
@triton.jit
def online_softmax(m_i, l_i, s):
    """Fold a tile of scores s (M, N) into the running max m_i (M,) and sum l_i (M,) (Milakov &
    Gimelshein 2018). Returns the new max and sum, the tile's exp(s - max) and alpha, the factor
    that rescales what was accumulated so far: acc = acc * alpha + p @ V (each caller multiplies p
    into V its own way: tl.dot for a tile of rows, a sum for one row). Its PyTorch twin, which also
    does that product, is `labkit.flash.online_softmax_step`; every kernel below calls this one."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def load_kv_tile(K, V, base, cols, offs_d, n, D: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `cols` (BLOCK_N,) of K and V for one (batch, key/value head), whose rows start at `base` in
    contiguous (B, H, N, D) tensors: two (BLOCK_N, D) tiles, rows at or past `n` masked to zeros (never read).
    Every kernel that walks keys loads them here (Triton's tutorial 06 keeps its key loop in one inner function)."""
    ptrs = base + cols[:, None] * D + offs_d[None, :]
    k = tl.load(K + ptrs, mask=cols[:, None] < n, other=0.0)
    v = tl.load(V + ptrs, mask=cols[:, None] < n, other=0.0)
    if UPCAST:                                       # the interpreter's tl.dot needs fp32 (see the docstring above)
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def load_q_tile(Q, DO, LSE, DELTA, bh, rows, offs_d, Nq, D: tl.constexpr, UPCAST: tl.constexpr):
    """What the backward reads of rows `rows` (BLOCK_M,) of one (batch, query head): two (BLOCK_M, D) tiles of
    Q and dO, and the rows' saved log-sum-exp and D = rowsum(dO * O); rows at or past Nq masked to zeros."""
    ptrs = bh * Nq * D + rows[:, None] * D + offs_d[None, :]
    q = tl.load(Q + ptrs, mask=rows[:, None] < Nq, other=0.0)
    do = tl.load(DO + ptrs, mask=rows[:, None] < Nq, other=0.0)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    lse = tl.load(LSE + bh * Nq + rows, mask=rows < Nq, other=0.0)
    delta = tl.load(DELTA + bh * Nq + rows, mask=rows < Nq, other=0.0)
    return q, do, lse, delta


@triton.jit
def _fold_keys(q, k, v, valid, m_i, l_i, acc):
    """One query row (q (1, D), already scaled) against a tile of keys k, v (N, D): no tl.dot for one row."""
    s = tl.where(valid[None, :], tl.sum(k * q, 1)[None, :], float("-inf"))    # (1, N) scores
    m_i, l_i, p, alpha = online_softmax(m_i, l_i, s)
    return m_i, l_i, acc * alpha[:, None] + tl.sum(tl.trans(p) * v, 0)[None, :]


# ---------------------------------------------------------------- forward
@triton.jit
def flash_fwd_kernel(Q, K, V, O, LSE, scale, Nq, Nk, Hq, GROUP,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
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
        k, v = load_kv_tile(K, V, kv_base, cols, offs_d, Nk, D, UPCAST)     # (BLOCK_N, D) each
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale     # (BLOCK_M, BLOCK_N) scores
        valid = cols[None, :] < Nk
        if CAUSAL:
            valid = valid & (offs_m[:, None] + shift >= cols[None, :])
        s = tl.where(valid, s, float("-inf"))
        m_i, l_i, p, alpha = online_softmax(m_i, l_i, s)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    rows = offs_m < Nq
    tl.store(O + q_base + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=rows[:, None])
    tl.store(LSE + bh * Nq + offs_m, m_i + tl.log(l_i), mask=rows)   # all backward needs of P


# ---------------------------------------------------------------- backward
@triton.jit
def _p_and_ds(q, k, v, do, lse, delta, rows, cols, Nq, Nk, scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """One (queries x keys) tile of the backward, shared by both kernels: P recomputed from the saved
    log-sum-exp (never stored), and dS = P * (dP - D) with dP = dO V^T and D = rowsum(dO * O)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale     # (BLOCK_M, BLOCK_N), as in forward
    valid = (rows[:, None] < Nq) & (cols[None, :] < Nk)
    if CAUSAL:                                                 # bottom-right aligned, as in forward
        valid = valid & (rows[:, None] + Nk - Nq >= cols[None, :])
    p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION).to(tl.float32)
    return p, p * (dp - delta[:, None])


@triton.jit
def flash_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, scale, Nq, Nk, Hq, GROUP,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
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
    k, v = load_kv_tile(K, V, kv_base, offs_n, offs_d, Nk, D, UPCAST)      # this program's tile, kept on chip
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    shift = Nk - Nq
    lo = 0
    if CAUSAL:                                                 # earlier queries never see these keys
        lo = tl.maximum(start_n * BLOCK_N - shift, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        bh = (kv_bh // Hkv) * Hq + (kv_bh % Hkv) * GROUP + g   # a query head reading this K/V head
        for start_m in range(lo, Nq, BLOCK_M):
            rows = start_m + offs_m
            q, do, lse, delta = load_q_tile(Q, DO, LSE, DELTA, bh, rows, offs_d, Nq, D, UPCAST)
            p, ds = _p_and_ds(q, k, v, do, lse, delta, rows, offs_n, Nq, Nk, scale, CAUSAL, PRECISION)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION).to(tl.float32)
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION).to(tl.float32)
    tl.store(DK + kv_base + offs_n[:, None] * D + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_base + offs_n[:, None] * D + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def flash_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, scale, Nq, Nk, Hq, GROUP,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dQ = scale * dS K for one tile of queries, over every key."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    kv_bh = (bh // Hq) * (Hq // GROUP) + (bh % Hq) // GROUP
    q_base, kv_base = bh * Nq * D, kv_bh * Nk * D
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q, do, lse, delta = load_q_tile(Q, DO, LSE, DELTA, bh, offs_m, offs_d, Nq, D, UPCAST)   # this program's rows
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    shift = Nk - Nq
    hi = tl.minimum((start_m + 1) * BLOCK_M + shift, Nk) if CAUSAL else Nk
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        k, v = load_kv_tile(K, V, kv_base, cols, offs_d, Nk, D, UPCAST)
        _, ds = _p_and_ds(q, k, v, do, lse, delta, offs_m, cols, Nq, Nk, scale, CAUSAL, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION).to(tl.float32)
    tl.store(DQ + q_base + offs_m[:, None] * D + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=offs_m[:, None] < Nq)


# ---------------------------------------------------------------- decoding: one query, a long cache
@triton.jit
def decode_split_kernel(Q, K, V, O_PART, LSE_PART, scale, Nk, Hq, GROUP, SPLITS, split_len,
                        D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One query row against keys [split * split_len, (split + 1) * split_len): its partial output
    (normalised within the split) and the split's log-sum-exp."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    kv_bh = (bh // Hq) * (Hq // GROUP) + (bh % Hq) // GROUP
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + bh * D + offs_d[None, :]).to(tl.float32) * scale      # (1, D): one row
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, D], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, Nk)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k, v = load_kv_tile(K, V, kv_bh * Nk * D, cols, offs_d, end, D, True)   # fp32: one row, no tl.dot
        m_i, l_i, acc = _fold_keys(q, k, v, cols < end, m_i, l_i, acc)
    tl.store(O_PART + (bh * SPLITS + split) * D + offs_d[None, :], acc / l_i[:, None])
    tl.store(LSE_PART + bh * SPLITS + split + tl.arange(0, 1), m_i + tl.log(l_i))


# ---------------------------------------------------------------- decoding through block tables
@triton.jit
def paged_decode_kernel(Q, K_CACHE, V_CACHE, TABLE, SEQ_LENS, O, scale, Hq, GROUP, max_blocks,
                        stride_blk, stride_tok, stride_head,
                        D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One query row of sequence b against its cache, block by block through its block table."""
    bh = tl.program_id(0)
    b = bh // Hq
    kv_head = (bh % Hq) // GROUP
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, D)
    seq_len = tl.load(SEQ_LENS + b)
    q = tl.load(Q + bh * D + offs_d[None, :]).to(tl.float32) * scale
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, D], tl.float32)
    for i in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(TABLE + b * max_blocks + i).to(tl.int64)           # logical block i -> physical
        valid = i * BLOCK_SIZE + offs_t < seq_len                          # the last block may be part-full
        ptrs = block * stride_blk + offs_t[:, None] * stride_tok + kv_head * stride_head + offs_d[None, :]
        k = tl.load(K_CACHE + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(V_CACHE + ptrs, mask=valid[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc = _fold_keys(q, k, v, valid, m_i, l_i, acc)
    tl.store(O + bh * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))


# ---------------------------------------------------------------- the launchers labkit.flash calls
# Arguments arrive validated and contiguous (labkit.flash checks them); each returns what its twin
# in labkit.flash returns.
def _result_buffer(like):
    """Where a kernel writes a result shaped like `like`: fp32 under the interpreter (see `_result`)."""
    return torch.empty_like(like, dtype=torch.float32 if INTERPRETED else like.dtype)


def _result(buffer, dtype):
    """The kernel's result in `dtype`, rounded to nearest by torch (the interpreter would truncate)."""
    return buffer.to(dtype)


def _launch(kernel, grid, *args, **consts):
    """kernel[grid](*args, **consts); where its tiles overflow this GPU's shared memory (Triton pipelines
    several stages of K and V tiles by default: fp32 at d = 128 on a 100 KiB card), again with one stage."""
    try:
        kernel[grid](*args, **consts)
    except triton.runtime.OutOfResources:
        kernel[grid](*args, num_stages=1, **consts)


def _consts(q, causal, block_m, block_n):
    return dict(D=q.shape[-1], BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
                UPCAST=INTERPRETED and q.dtype != torch.float32,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")   # tf32 is ignored by 16-bit dots


def forward_triton(q, k, v, causal, scale, block_m, block_n):
    """(O in q's dtype, fp32 log-sum-exp (B, Hq, Nq)) by `flash_fwd_kernel`."""
    B, Hq, Nq, _ = q.shape
    o = _result_buffer(q)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(Nq, block_m), B * Hq)
    _launch(flash_fwd_kernel, grid, q, k, v, o, lse, scale, Nq, k.shape[2], Hq, Hq // k.shape[1],
            **_consts(q, causal, block_m, block_n))
    return _result(o, q.dtype), lse


def backward_triton(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    """(dq, dk, dv) by `flash_bwd_dkdv_kernel` (one program per key tile) and `flash_bwd_dq_kernel`."""
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    delta = (do.float() * o.float()).sum(-1)               # D = rowsum(dO * O), (B, Hq, Nq) fp32
    dq, dk, dv = _result_buffer(q), _result_buffer(k), _result_buffer(v)
    args, consts = (scale, Nq, Nk, Hq, Hq // Hkv), _consts(q, causal, block_m, block_n)
    _launch(flash_bwd_dkdv_kernel, (triton.cdiv(Nk, block_n), B * Hkv), q, k, v, do, lse, delta, dk, dv, *args, **consts)
    _launch(flash_bwd_dq_kernel, (triton.cdiv(Nq, block_m), B * Hq), q, k, v, do, lse, delta, dq, *args, **consts)
    return _result(dq, q.dtype), _result(dk, k.dtype), _result(dv, v.dtype)


def decode_triton(q, k, v, split_len, scale, block_n):
    """fp32 (o_parts (B, Hq, S, d), lse_parts (B, Hq, S)) of one query per head, by `decode_split_kernel`."""
    B, Hq, _, D = q.shape
    Nk = k.shape[2]
    splits = triton.cdiv(Nk, split_len)
    o_parts = torch.empty(B, Hq, splits, D, device=q.device, dtype=torch.float32)
    lse_parts = torch.empty(B, Hq, splits, device=q.device, dtype=torch.float32)
    decode_split_kernel[(splits, B * Hq)](q, k, v, o_parts, lse_parts, scale, Nk, Hq, Hq // k.shape[1], splits,
                                          split_len, D=D, BLOCK_N=block_n)
    return o_parts, lse_parts


def paged_triton(q, k_cache, v_cache, block_table, seq_lens, scale):
    """(B, Hq, d) in q's dtype: one query per sequence through its block table, by `paged_decode_kernel`."""
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    o = _result_buffer(q)
    table, lens = block_table.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    paged_decode_kernel[(B * Hq,)](q, k_cache, v_cache, table, lens, o, scale, Hq, Hq // Hkv, table.shape[1],
                                   k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                   D=D, BLOCK_SIZE=block_size)
    return _result(o, q.dtype)
