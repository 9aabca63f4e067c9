"""FlashAttention forward and backward, flash-decoding and paged attention: each in plain PyTorch and in Triton.

After Triton's tutorial 06-fused-attention and Dao 2023 (FlashAttention-2, Algorithms 1 and 2):

- forward: K and V stream through in BLOCK_N-row tiles with a running max `m`, sum `l` and an fp32
  accumulator (the online softmax, `online_softmax_step`), never forming the N x N scores; it returns
  O and each row's log-sum-exp `lse = m + log(l)` (4 bytes a row), all that backward needs;
- backward: P is recomputed tile by tile from the saved `lse` (`P = exp(S - lse)`), with
  `D = rowsum(dO * O)` (so `dS = P * (dP - D)`). `flash_attention` wraps both in a
  `torch.autograd.Function`, so autograd holds only O and the log-sum-exp between the two passes;
- grouped-query / multi-query attention: K and V may have fewer heads than Q (`Hq % Hkv == 0`), query
  head `h` reads key/value head `h // (Hq // Hkv)`, as in Llama-3;
- Nq != Nk with the causal mask aligned bottom-right (query i sees keys j <= i + Nk - Nq), the
  convention of flash-attn >= 2.1 for decoding and chunked prefill (SDPA's `is_causal` aligns top-left);
- decoding: `flash_decode` splits one query's keys into whole key blocks and combines the partial
  results through their log-sum-exps (`combine_splits`; flash-decoding, Dao et al. 2023 blog);
  `paged_attention` reads K/V through a block table (vLLM's PagedAttention, Kwon et al. 2023), the
  tables of notebook 07 (`labkit.paged`);
- IO complexity: `standard_attention_io` and `flash_attention_io` are the paper's Algorithms 0 and 1
  (Dao et al. 2022) for one head, counting in an `HBMTraffic` every byte a block load or store moves
  between HBM and SRAM (notebook 08 fits their exponents in N, d and M against Theorem 2).

Two backends, one switch (the slow path beside the fast one, as nanoGPT keeps it): each public function
takes `backend="auto" | "torch" | "triton"`; "auto" is "triton" where `lk.has("triton")`, else "torch".
The PyTorch twins are the `*_torch` functions below, the same algorithms written with torch ops (tiles
of keys in a Python loop; all query rows form one tile, where a kernel gives each tile of rows its own
program). The Triton kernels live in `labkit.flash_triton` (the `*_triton` functions), imported only
when asked for, so this module, its twins and notebook 08 run wherever PyTorch does. Both accumulate
in fp32 whatever their inputs are, and accept exactly the same arguments: every argument is checked
before any work, by `labkit.flash_checks` (one check per public function, so the algorithms here read alone).
"""
from __future__ import annotations

import math

import torch

from .device import has
from .flash_checks import check_attention, check_decode, check_io, check_paged

__all__ = ["flash_attention", "flash_decode", "paged_attention", "combine_splits", "online_softmax_step",
           "forward_torch", "backward_torch", "decode_torch", "paged_torch", "kernel_source", "kernel_code",
           "HBMTraffic", "standard_attention_io", "flash_attention_io", "BACKENDS"]

BACKENDS = ("auto", "torch", "triton")


# ---------------------------------------------------------------- the online softmax, written once
def online_softmax_step(m, l, acc, s, v):
    """Fold one tile of scores s (..., M, n) of keys with values v (..., n, d) into the running max
    m (..., M), sum l (..., M) and output acc (..., M, d) (Milakov & Gimelshein 2018); returns them new.

    Every row must see a key in its first tile (otherwise exp(-inf - -inf) is NaN): true for all
    callers here, which start at key 0, visible to every row."""
    m_new = torch.maximum(m, s.amax(-1))
    p = torch.exp(s - m_new[..., None])             # (..., M, n): the tile's probabilities, not yet normalised
    alpha = torch.exp(m - m_new)                    # rescales what was summed against the old max
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def _grouped(x, kv_heads):
    """(B, Hq, N, d) -> (B, Hkv, Hq // Hkv, N, d): the query heads that read each key/value head."""
    B, Hq, N, D = x.shape
    return x.reshape(B, kv_heads, Hq // kv_heads, N, D)


def _visible(rows, start, n, Nq, Nk, device):
    """(rows, n) bool: which of keys [start, start + n) each query row sees, causal aligned bottom-right."""
    cols = torch.arange(start, start + n, device=device)
    return cols[None, :] <= torch.arange(rows, device=device)[:, None] + (Nk - Nq)


# ---------------------------------------------------------------- the PyTorch twins
def _tiles(q, k, v, causal, scale, block_n):
    """The forward's loop over key tiles: fp32 O (B, Hkv, G, Nq, d) and lse (B, Hkv, G, Nq)."""
    Nq, Nk = q.shape[2], k.shape[2]
    qg = _grouped(q, k.shape[1]).float()                        # (B, Hkv, G, Nq, d)
    m = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
    l = torch.zeros(qg.shape[:-1], device=q.device)
    acc = torch.zeros(qg.shape, device=q.device)
    for start in range(0, Nk, block_n):
        kb, vb = (t[:, :, None, start:start + block_n].float() for t in (k, v))   # (B, Hkv, 1, n, d)
        s = (qg @ kb.transpose(-1, -2)) * scale                 # (B, Hkv, G, Nq, n): one tile of scores
        if causal:
            s = s.masked_fill(~_visible(Nq, start, kb.shape[-2], Nq, Nk, q.device), float("-inf"))
        m, l, acc = online_softmax_step(m, l, acc, s, vb)
    return acc / l[..., None], m + torch.log(l)


def forward_torch(q, k, v, causal, scale, block_m, block_n):
    """(O in q's dtype, fp32 lse (B, Hq, Nq)): the twin of `flash_fwd_kernel` (block_m is the kernel's
    unit of parallelism; here all query rows form one tile)."""
    o, lse = _tiles(q, k, v, causal, scale, block_n)
    return o.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:-1])


def backward_torch(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    """(dq, dk, dv), one tile of keys at a time from the saved log-sum-exp (Dao 2023, Algorithm 2):
    P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dK = scale dS^T Q, dQ = scale dS K.
    The twin of `flash_bwd_dkdv_kernel` and `flash_bwd_dq_kernel`; with GQA, dK and dV sum over the
    query heads that read each key/value head."""
    Hkv, Nq, Nk = k.shape[1], q.shape[2], k.shape[2]
    qg, dog = _grouped(q, Hkv).float(), _grouped(do, Hkv).float()       # (B, Hkv, G, Nq, d)
    lse_g = lse.reshape(qg.shape[:-1])
    delta = (dog * _grouped(o, Hkv).float()).sum(-1)                    # D = rowsum(dO * O), (B, Hkv, G, Nq)
    dq, dk, dv = torch.zeros_like(qg), torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device)
    for start in range(0, Nk, block_n):
        kb, vb = (t[:, :, None, start:start + block_n].float() for t in (k, v))   # (B, Hkv, 1, n, d)
        s = (qg @ kb.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(~_visible(Nq, start, kb.shape[-2], Nq, Nk, q.device), float("-inf"))
        p = torch.exp(s - lse_g[..., None])                             # (B, Hkv, G, Nq, n), recomputed
        ds = p * (dog @ vb.transpose(-1, -2) - delta[..., None])
        dv[:, :, start:start + block_n] = (p.transpose(-1, -2) @ dog).sum(2)
        dk[:, :, start:start + block_n] = (ds.transpose(-1, -2) @ qg).sum(2) * scale
        dq += (ds @ kb) * scale
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def decode_torch(q, k, v, split_len, scale, block_n):
    """fp32 (o_parts (B, Hq, S, d), lse_parts (B, Hq, S)): the forward over each split of split_len keys
    (whole key blocks), the twin of `decode_split_kernel`."""
    parts = [_tiles(q, k[:, :, a:a + split_len], v[:, :, a:a + split_len], False, scale, block_n)
             for a in range(0, k.shape[2], split_len)]
    B, Hq, _, D = q.shape
    o_parts = torch.stack([o.reshape(B, Hq, D) for o, _ in parts], 2)
    lse_parts = torch.stack([lse.reshape(B, Hq) for _, lse in parts], 2)
    return o_parts, lse_parts


def paged_torch(q, k_cache, v_cache, block_table, seq_lens, scale):
    """(B, Hq, d) in q's dtype: each sequence's keys read block by block through its block table, folded
    in by the online softmax; the twin of `paged_decode_kernel`."""
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, 1, D)                     # (B, Hkv, G, 1, d)
    m = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
    l = torch.zeros(qg.shape[:-1], device=q.device)
    acc = torch.zeros(qg.shape, device=q.device)
    for i in range(-(-int(seq_lens.max()) // block_size)):             # logical block i of every sequence
        valid = i * block_size + torch.arange(block_size, device=q.device) < seq_lens[:, None]   # (B, bs)
        blocks = torch.where(valid[:, 0], block_table[:, i], 0).long()  # a finished sequence reads block 0, masked
        kb, vb = (c[blocks].float().permute(0, 2, 1, 3)[:, :, None] for c in (k_cache, v_cache))  # (B, Hkv, 1, bs, d)
        s = (qg @ kb.transpose(-1, -2)) * scale                         # (B, Hkv, G, 1, bs)
        s = s.masked_fill(~valid[:, None, None, None, :], float("-inf"))
        m, l, acc = online_softmax_step(m, l, acc, s, vb)
    return (acc / l[..., None]).reshape(B, Hq, D).to(q.dtype)


# ---------------------------------------------------------------- one switch
def _backend(backend):
    """The functions of `backend`: {"forward", "backward", "decode", "paged"} -> the twin or the kernel's launcher."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if has("triton") else "torch"
    if backend == "torch":
        return dict(forward=forward_torch, backward=backward_torch, decode=decode_torch, paged=paged_torch)
    if not has("triton"):
        raise ModuleNotFoundError("backend='triton' needs triton, which is not installed here (pip install triton "
                                  "on Linux); backend='torch' runs the same algorithm in plain PyTorch")
    from . import flash_triton as ft
    return dict(forward=ft.forward_triton, backward=ft.backward_triton, decode=ft.decode_triton, paged=ft.paged_triton)


KERNELS = dict(forward="flash_fwd_kernel", backward_dkdv="flash_bwd_dkdv_kernel", backward_dq="flash_bwd_dq_kernel",
               decode="decode_split_kernel", paged="paged_decode_kernel", online_softmax="online_softmax",
               kv_tile="load_kv_tile", q_tile="load_q_tile")


def _kernel_node(name):
    """(path of flash_triton.py, the ast node of kernel `name`, the file's text): read, never imported."""
    import ast
    import pathlib
    if name not in KERNELS:
        raise ValueError(f"name must be one of {sorted(KERNELS)}, got {name!r}")
    path = pathlib.Path(__file__).parent / "flash_triton.py"
    text = path.read_text()
    node = next(n for n in ast.parse(text).body if getattr(n, "name", None) == KERNELS[name])
    return path, node, text


def kernel_source(name):
    """The source of a Triton kernel of `labkit.flash_triton` as text, read from the file (no triton needed):
    name is one of KERNELS ("forward", "backward_dkdv", "backward_dq", "decode", "paged", "online_softmax",
    "kv_tile", "q_tile")."""
    _, node, text = _kernel_node(name)
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])        # from its @triton.jit line
    return "\n".join(text.splitlines()[first - 1:node.end_lineno])


def kernel_code(name):
    """The Triton kernel `name` (see `kernel_source`) as a code object compiled from labkit/flash_triton.py,
    never run, so `lk.show(flash.kernel_code("forward"))` shows its lines from that file on any machine,
    with or without triton (where triton is installed, `lk.show(flash_triton.flash_fwd_kernel)` is the same)."""
    import ast
    path, node, _ = _kernel_node(name)
    code = compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec", dont_inherit=True)
    return next(c for c in code.co_consts if hasattr(c, "co_name") and c.co_name == KERNELS[name])


# ---------------------------------------------------------------- HBM traffic, counted where blocks move
class HBMTraffic:
    """Bytes moved between HBM (a GPU's main memory) and on-chip SRAM, counted where an algorithm loads a
    block of an array or stores one: `reads[name]`, `writes[name]` (bytes by array), `total`.

    `load(name, block)` and `store(name, block)` return the block itself: they only count its bytes."""

    def __init__(self):
        self.reads, self.writes = {}, {}

    def load(self, name, block):
        self.reads[name] = self.reads.get(name, 0) + block.numel() * block.element_size()
        return block

    def store(self, name, block):
        self.writes[name] = self.writes.get(name, 0) + block.numel() * block.element_size()
        return block

    @property
    def total(self):
        return sum(self.reads.values()) + sum(self.writes.values())

    def __repr__(self):
        return f"HBMTraffic(reads={self.reads}, writes={self.writes}, total={self.total})"


def standard_attention_io(q, k, v, traffic):
    """softmax(q k^T / sqrt(d)) v for one head's q, k, v (N, d) as standard attention runs it (Dao et al.
    2022, Algorithm 0): three kernels, each reading its inputs from HBM and writing its result back,
    S = QK^T (N x N), P = softmax(S) (N x N), O = PV. Every load and store is counted in `traffic`
    (on meta tensors only the counts are computed: the bytes depend on shapes alone)."""
    check_io(q, k, v)
    s = traffic.store("S", (traffic.load("Q", q) @ traffic.load("K", k).T) / math.sqrt(q.shape[1]))
    p = traffic.store("P", torch.softmax(traffic.load("S", s), dim=-1))
    return traffic.store("O", traffic.load("P", p) @ traffic.load("V", v))


def flash_attention_io(q, k, v, sram, traffic):
    """FlashAttention's forward as Dao et al. 2022 write it (Algorithm 1) for one head's q, k, v (N, d) on
    a chip with `sram` elements of SRAM (d <= sram <= N d): key/value blocks of B_c = ceil(sram / 4d)
    rows in the outer loop, query blocks of B_r = min(B_c, d) rows in the inner one; O (normalised), the
    running sum l and max m live in HBM and are read and written back at every step (the update is
    `online_softmax_step`). Every load and store is counted in `traffic`; returns O (N, d), fp32."""
    check_io(q, k, v, sram)
    N, d = q.shape
    b_c = -(-sram // (4 * d))
    b_r = min(b_c, d)
    scale = 1 / math.sqrt(d)
    o = torch.zeros(N, d, device=q.device)                         # in HBM, as l and m
    l = torch.zeros(N, device=q.device)
    m = torch.full((N,), float("-inf"), device=q.device)
    for j in range(0, N, b_c):                                     # outer loop: one block of keys and values
        kj, vj = traffic.load("K", k[j:j + b_c]).float(), traffic.load("V", v[j:j + b_c]).float()
        for i in range(0, N, b_r):                                 # inner loop: every block of queries
            qi, oi = traffic.load("Q", q[i:i + b_r]).float(), traffic.load("O", o[i:i + b_r])
            li, mi = traffic.load("l", l[i:i + b_r]), traffic.load("m", m[i:i + b_r])
            s = (qi @ kj.T) * scale                                # (B_r, B_c): on chip only
            m_new, l_new, acc = online_softmax_step(mi, li, oi * li[:, None], s, vj)
            o[i:i + b_r] = traffic.store("O", acc / l_new[:, None])
            l[i:i + b_r], m[i:i + b_r] = traffic.store("l", l_new), traffic.store("m", m_new)
    return o


# ---------------------------------------------------------------- the public functions
class _FlashAttention(torch.autograd.Function):
    """Forward saves (q, k, v, O, lse): q, k, v are the caller's own tensors (when contiguous), so
    autograd's extra holding between the passes is O and the fp32 log-sum-exp, B * H * Nq * (d * itemsize + 4) bytes."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_m, block_n, fns):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = fns["forward"](q, k, v, causal, scale, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.settings = (causal, scale, block_m, block_n, fns)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, block_m, block_n, fns = ctx.settings
        dq, dk, dv = fns["backward"](q, k, v, o, lse, do.contiguous(), causal, scale, block_m, block_n)
        return dq, dk, dv, None, None, None, None, None


def flash_attention(q, k, v, causal=False, sm_scale=None, block_m=32, block_n=32, return_lse=False, backend="auto"):
    """softmax(q k^T * sm_scale) v tile by tile, with a backward from the log-sum-exp for autograd.

    q: (batch, Hq, Nq, d); k, v: (batch, Hkv, Nk, d) with Hq a multiple of Hkv (GQA/MQA), Nk >= 1.
    `causal` aligns the mask bottom-right (query i sees keys j <= i + Nk - Nq). `sm_scale` defaults to
    1/sqrt(d). With `return_lse`, also the (batch, Hq, Nq) fp32 log-sum-exp of each row's scores.
    `backend`: "torch" (the twin), "triton" (the kernels) or "auto" (triton where installed).
    """
    fns = _backend(backend)
    scale = check_attention(q, k, v, causal, sm_scale, block_m=block_m, block_n=block_n)
    o, lse = _FlashAttention.apply(q, k, v, causal, scale, block_m, block_n, fns)
    return (o, lse) if return_lse else o


def combine_splits(o_parts, lse_parts):
    """Merge partial attention results over disjoint key sets: o_parts (..., S, d), lse_parts (..., S).

    With L = logsumexp_s(lse_s), each split's weight is exp(lse_s - L), the share of the softmax's
    denominator its keys hold: O = sum_s exp(lse_s - L) * O_s. Returns (O (..., d), L (...))."""
    lse = torch.logsumexp(lse_parts, dim=-1)
    weights = torch.exp(lse_parts - lse[..., None])            # (..., S), sums to 1
    return (weights[..., None] * o_parts).sum(-2), lse


def flash_decode(q, k, v, num_splits=4, sm_scale=None, block_n=32, return_parts=False, backend="auto"):
    """Attention of one new query per (batch, head) against a long K/V cache, split over key blocks.

    q: (batch, Hq, 1, d); k, v: (batch, Hkv, Nk, d). Each of at most `num_splits` splits (whole blocks
    of `block_n` keys, none empty; rounding each split up to whole blocks can leave fewer splits, e.g.
    Nk=300, num_splits=4, block_n=64 gives 3 of 128 keys) gives a partial output and log-sum-exp
    (flash-decoding: on a GPU one program per split and head, where one query row leaves a forward
    kernel one program per head);
    `combine_splits` merges them. Returns (batch, Hq, 1, d) in q's dtype, or with `return_parts` the
    fp32 partials (o_parts (B, Hq, S, d), lse_parts (B, Hq, S)) as well.
    """
    fns = _backend(backend)
    scale = check_decode(q, k, v, num_splits, sm_scale, block_n)
    Nk = k.shape[2]
    split_len = -(-(-(-Nk // num_splits)) // block_n) * block_n      # whole key blocks per split, none empty
    o_parts, lse_parts = fns["decode"](q.contiguous(), k.contiguous(), v.contiguous(), split_len, scale, block_n)
    o, _ = combine_splits(o_parts, lse_parts)
    o = o[:, :, None, :].to(q.dtype)
    return (o, o_parts, lse_parts) if return_parts else o


def paged_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale=None, backend="auto"):
    """Decode attention with K/V stored in fixed-size blocks (PagedAttention).

    q: (batch, Hq, d), one new query per sequence; k_cache, v_cache: (num_blocks, block_size, Hkv, d);
    block_table: (batch, max_blocks) int, physical block of each sequence's logical block i (entries
    past a sequence's length are ignored); seq_lens: (batch,) int, tokens cached per sequence (>= 1).
    Returns (batch, Hq, d) in q's dtype.
    """
    fns = _backend(backend)
    scale = check_paged(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
    return fns["paged"](q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), block_table, seq_lens, scale)
