"""Two custom kernels for notebook 12, each with its plain PyTorch twin beside it (the slow path beside
the fast one, as nanoGPT keeps it): a blocked matmul, and a cross-entropy that never builds the logits.

Matmul. `matmul_kernel` follows Triton's tutorial 03 (matrix multiplication): each program computes one
BLOCK_M x BLOCK_N tile of C, walking K in BLOCK_K steps with `tl.dot`. Programs are numbered in
*grouped* order (`grouped_pid`): GROUP_M tile-rows at a time, column by column, so that programs that
run at the same moment share rows of A and columns of B, and those stay in the L2 cache.
`tiled_matmul` is its twin: the same programs in the same order, each one a loop over K tiles in
PyTorch, recording which panels it read (`panels_read` counts them per wave; `blocks_loaded` is the
same count from the order alone). `round_to_tf32` is what `tl.dot(..., input_precision="tf32")` and
cuBLAS with TF32 do to fp32 inputs: keep 10 of the 23 mantissa bits.

Cross-entropy. `linear_cross_entropy(hidden, weight, targets)` is `F.cross_entropy(hidden @ weight.T,
targets)` without the N x V logits (a `torch.autograd.Function`, `LinearCrossEntropy`): forward keeps
only each row's log-sum-exp, and backward recomputes one chunk of logits at a time. Its forward is one of
FORWARDS: "chunked" (`chunked_lse_and_target`: `chunk` rows of logits at a time), "online"
(`online_lse_and_target`: the fused kernel's algorithm in PyTorch, an online log-sum-exp over
vocabulary tiles, as FlashAttention does over keys) or "triton" (`cross_entropy_kernel`, one Triton
kernel, so not even a chunk of logits exists).

triton is optional (`lk.has("triton")` is the one switch): it is imported the first time a Triton
kernel runs, never by importing this module. Without a CUDA device Triton runs kernels on CPU tensors
through its interpreter, which it chooses when it is first imported: importing this module sets
TRITON_INTERPRET=1 then (as labkit/flash.py does), and the kernels say so if triton came first. The
interpreter computes `tl.dot` wrongly on 16-bit inputs, so there tiles are upcast to fp32 (UPCAST), and
it multiplies fp32 exactly whatever `input_precision` says.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import sys

import torch

from .checks import count, power_of_two
from .device import has

__all__ = ["grouped_pid", "blocks_loaded", "tiled_matmul", "panels_read", "round_to_tf32", "matmul",
           "matmul_kernel", "check_matmul_args", "cublas_precision", "cross_entropy_reference", "check_ce_args",
           "chunked_lse_and_target", "online_lse_and_target", "triton_lse_and_target", "cross_entropy_kernel",
           "LinearCrossEntropy", "linear_cross_entropy", "interpreted", "PRECISIONS", "FORWARDS"]

PRECISIONS = ("ieee", "tf32")      # how tl.dot multiplies fp32 inputs on a GPU; Triton's default is "tf32"
FORWARDS = ("chunked", "online", "triton")
TILE = " (tl.dot's smallest tile)"
tl = None                          # triton.language, bound by _jitted() on first use (the kernels read it)
# Without CUDA, Triton must see TRITON_INTERPRET=1 when it is first imported (torch's compiler stack may
# import it too): choose now, import nothing. Too late if triton came first without it.
_TOO_LATE = not torch.cuda.is_available() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- the grouped ordering, in plain Python (what the kernel computes from tl.program_id) ----------
def grouped_pid(pid, num_pid_m, num_pid_n, group_m):
    """The (tile row, tile column) that program `pid` computes in grouped order.

    Programs walk down GROUP_M tile-rows, then move one tile-column right; the last group may have
    fewer rows. With group_m=1 this is plain row-major order."""
    pid = count("pid", pid, 0)
    num_pid_m, num_pid_n, group_m = count("num_pid_m", num_pid_m), count("num_pid_n", num_pid_n), count("group_m", group_m)
    if pid >= num_pid_m * num_pid_n:
        raise ValueError(f"pid must be below num_pid_m * num_pid_n = {num_pid_m * num_pid_n}, got {pid}")
    num_pid_in_group = group_m * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * group_m
    group_size_m = min(num_pid_m - first_pid_m, group_m)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


def blocks_loaded(num_pid_m, num_pid_n, group_m, wave):
    """Distinct tile-rows of A plus tile-columns of B that `wave` consecutive programs read, summed over
    the waves: a count of what must come from DRAM when only one wave's inputs fit in the cache."""
    count("wave", wave)
    total, n = 0, num_pid_m * num_pid_n
    for start in range(0, n, wave):
        tiles = [grouped_pid(p, num_pid_m, num_pid_n, group_m) for p in range(start, min(start + wave, n))]
        total += len({m for m, _ in tiles}) + len({c for _, c in tiles})
    return total


def round_to_tf32(x):
    """fp32 -> fp32 with TF32's 10-bit mantissa (round to nearest, ties away from zero, as the GPU's
    cvt.rna.tf32.f32): the inputs a tensor core multiplies when TF32 is on. Products of two such values
    are exact in fp32, so a TF32 matmul is this rounding followed by an fp32 matmul."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(f"x must be an fp32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)   # drop the low 13 of 23 mantissa bits, rounded


def check_matmul_args(a, b, block_m, block_n, block_k, group_m, precision):
    """ValueError naming the argument, before any work, unless a @ b can run with these tiles."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"a and b must be 2-D tensors, got {getattr(a, 'shape', a)!r} and {getattr(b, 'shape', b)!r}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions must agree, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"a and b must share one dtype of fp32, fp16 or bf16, got {a.dtype} and {b.dtype}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        power_of_two(name, v, 16, TILE)
    count("group_m", group_m)


@contextlib.contextmanager
def cublas_precision(precision):
    """Inside the block, fp32 matmuls on a GPU (cuBLAS, what `a @ b` calls) multiply in `precision`: "ieee"
    (true fp32, torch's default) or "tf32" (TF32 on tensor cores); the setting before is restored after.

    One API throughout, `torch.set_float32_matmul_precision` ("highest" or "high"): it keeps the legacy flag
    `torch.backends.cuda.matmul.allow_tf32` (which cuBLASLt's paths, linear with bias and batched matmul,
    read) and the newer `torch.backends.cuda.matmul.fp32_precision` in agreement. Setting only the newer one
    leaves them mixed, and reading the legacy one then raises ("mix of the legacy and new APIs")."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision({"ieee": "highest", "tf32": "high"}[precision])
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# ---- the blocked matmul: the PyTorch twin ----------------------------------------------------------
def tiled_matmul(a, b, block_m=32, block_n=32, block_k=32, group_m=4, precision="ieee", reads=None):
    """a @ b computed as `matmul_kernel` computes it: one program per BLOCK_M x BLOCK_N tile of C, run in
    grouped order (`grouped_pid`), each walking K in BLOCK_K steps with an fp32 accumulator; output in
    a's dtype. precision="tf32" rounds fp32 tiles to TF32 first, as tl.dot does on a GPU by default.
    reads: a list to which each program appends (pid, rows of A it read, columns of B it read)."""
    check_matmul_args(a, b, block_m, block_n, block_k, group_m, precision)
    if reads is not None and not isinstance(reads, list):
        raise TypeError(f"reads must be a list to append to, or None, got {type(reads).__name__}")
    (M, K), N = a.shape, b.shape[1]
    num_pid_m, num_pid_n = -(-M // block_m), -(-N // block_n)
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    for pid in range(num_pid_m * num_pid_n):                       # the launch grid, in program order
        pid_m, pid_n = grouped_pid(pid, num_pid_m, num_pid_n, group_m)
        rows = slice(pid_m * block_m, min((pid_m + 1) * block_m, M))   # the last tiles are ragged: the masks
        cols = slice(pid_n * block_n, min((pid_n + 1) * block_n, N))
        acc = torch.zeros((rows.stop - rows.start, cols.stop - cols.start), device=a.device, dtype=torch.float32)
        for k0 in range(0, K, block_k):
            a_tile = a[rows, k0:k0 + block_k].float()              # (BLOCK_M, BLOCK_K)
            b_tile = b[k0:k0 + block_k, cols].float()              # (BLOCK_K, BLOCK_N)
            if precision == "tf32" and a.dtype == torch.float32:
                a_tile, b_tile = round_to_tf32(a_tile), round_to_tf32(b_tile)
            acc += a_tile @ b_tile
        c[rows, cols] = acc.to(a.dtype)
        if reads is not None:
            reads.append((pid, (rows.start, rows.stop), (cols.start, cols.stop)))
    return c


def panels_read(reads, wave):
    """Distinct panels (tile-rows of A, tile-columns of B) that each `wave` consecutive programs of a
    `tiled_matmul(..., reads=...)` run read, summed over the waves."""
    if not isinstance(reads, list) or not reads:
        raise ValueError(f"reads must be the non-empty list that tiled_matmul(reads=...) filled, got {reads!r}")
    count("wave", wave)
    total = 0
    for start in range(0, len(reads), wave):
        batch = reads[start:start + wave]
        total += len({r for _, r, _ in batch}) + len({c for _, _, c in batch})
    return total


# ---- the blocked matmul in Triton: kernel source (jitted on first use) and its launcher ----------
def matmul_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """The Triton kernel behind `matmul` (launched through triton.jit); `tiled_matmul` is its twin."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n              # grouped order: see grouped_pid()
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak     # (BLOCK_M, BLOCK_K) tile of A
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn     # (BLOCK_K, BLOCK_N) tile of B
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_JITTED = {}                       # filled by _jitted() on first use


def _jitted():
    """triton, imported now (not before: it is optional), and this module's kernels wrapped by triton.jit."""
    global tl
    if _JITTED:
        return _JITTED["triton"], _JITTED
    if not has("triton"):
        raise ImportError("the Triton kernels need triton (pip install triton, or labkit's 'kernels' extra); "
                          "their PyTorch twins (tiled_matmul, online_lse_and_target) run without it")
    if _TOO_LATE or not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError("triton was imported before labkit.kernels could choose its CPU interpreter: import "
                          "labkit.kernels first, or start Python with TRITON_INTERPRET=1")
    import triton
    import triton.language
    tl = triton.language
    if not torch.cuda.is_available():
        _squeeze_interpreter_scalars()
    _JITTED.update(triton=triton, matmul=triton.jit(matmul_kernel), cross_entropy=triton.jit(cross_entropy_kernel))
    return triton, _JITTED


def _squeeze_interpreter_scalars():
    """Let Triton's interpreter before 3.7 read a scalar argument as a loop bound (`range(tl.cdiv(K, BLOCK_K))`)
    under NumPy 2.4 and later. It holds each scalar as an array of shape (1,) and reads it with `int(array)`,
    which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars";
    triton-lang/triton#9171, fixed in 3.7 by squeezing the array first). The same fix, for an older interpreter:
    True if applied, False where nothing needed it."""
    import numpy as np
    from triton.runtime import interpreter
    try:
        int(np.array([1]))
        return False                                  # this NumPy still converts shape-(1,) arrays
    except TypeError:
        pass
    patch = getattr(interpreter, "_patch_lang_tensor", None)   # sets tl.tensor's methods for each launch
    if patch is None or list(inspect.signature(patch).parameters) != ["tensor", "scope"]:
        return False
    if "data.squeeze()" in inspect.getsource(patch) or getattr(patch, "squeezes", False):
        return False                                  # Triton 3.7 or later, or applied already

    def squeezing(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    squeezing.squeezes = True
    interpreter._patch_lang_tensor = squeezing
    return True


def interpreted():
    """True if the Triton kernels run through Triton's interpreter (no CUDA device), False if compiled."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(_jitted()[1]["matmul"], InterpretedFunction)


def matmul(a, b, block_m=32, block_n=32, block_k=32, group_m=4, precision="ieee", num_warps=4, num_stages=3):
    """a @ b for 2-D tensors by the blocked Triton kernel (fp32 accumulation, output in a's dtype).

    precision: how tl.dot multiplies fp32 inputs on a GPU: "ieee" (true fp32) or "tf32" (Triton's own
    default: 10-bit mantissa on tensor cores). Ignored for 16-bit inputs and under the interpreter.
    num_warps, num_stages: the compiled kernel's launch options (the interpreter ignores them)."""
    check_matmul_args(a, b, block_m, block_n, block_k, group_m, precision)
    triton, kernels = _jitted()
    upcast = interpreted() and a.dtype != torch.float32
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=a.dtype)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    kernels["matmul"][grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            c.stride(0), c.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                            GROUP_M=group_m, PRECISION=precision, UPCAST=upcast,
                            **({} if interpreted() else {"num_warps": num_warps, "num_stages": num_stages}))
    return c


# ---- cross-entropy over a large vocabulary, without the logits -------------------------------------
def check_ce_args(hidden, weight, targets, **positive):
    """ValueError naming the argument, before any work, unless hidden (N, D), weight (V, D) and int64 targets
    (N,) fit together and every keyword in `positive` (chunk=..., block_v=...) is a positive int."""
    for name, value in positive.items():
        count(name, value)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a 2-D (tokens, hidden) tensor, got {getattr(hidden, 'shape', hidden)!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be a (vocab, {hidden.shape[1]}) tensor, got {getattr(weight, 'shape', weight)!r}")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:1] or targets.dtype != torch.long:
        raise ValueError(f"targets must be an int64 tensor of shape ({hidden.shape[0]},), got "
                         f"{getattr(targets, 'dtype', type(targets).__name__)} {tuple(getattr(targets, 'shape', ()))}")


def cross_entropy_reference(hidden, weight, targets, ignore_index=-100, reduction="mean"):
    """The plain version: all N x V logits, then F.cross_entropy (mean over targets != ignore_index)."""
    return torch.nn.functional.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=ignore_index,
                                             reduction=reduction)


def chunked_lse_and_target(hidden, weight, targets, chunk=256):
    """Each row's log-sum-exp of hidden @ weight.T and its target's logit, `chunk` rows of logits at a time."""
    check_ce_args(hidden, weight, targets, chunk=chunk)
    lse = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    tgt = torch.empty_like(lse)
    safe = targets.clamp(min=0)                             # ignored rows (-100) read column 0, then drop out
    for s in range(0, hidden.shape[0], chunk):
        logits = (hidden[s:s + chunk] @ weight.T).float()  # (chunk, V): the only logits alive
        lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
        tgt[s:s + chunk] = logits.gather(1, safe[s:s + chunk, None])[:, 0]
        del logits
    return lse, tgt


def online_lse_and_target(hidden, weight, targets, block_m=16, block_v=64):
    """What `cross_entropy_kernel` computes, in PyTorch: per block of `block_m` rows, the vocabulary
    streams through in tiles of `block_v` with a running max and sum (the online softmax), so at most one
    (block_m, block_v) tile of logits exists. fp32 accumulation, as tl.dot's."""
    check_ce_args(hidden, weight, targets, block_m=block_m, block_v=block_v)
    lse = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    tgt = torch.empty_like(lse)
    V = weight.shape[0]
    for r0 in range(0, hidden.shape[0], block_m):                  # one program of the kernel
        h, t = hidden[r0:r0 + block_m].float(), targets[r0:r0 + block_m]
        m_i = torch.full((h.shape[0],), float("-inf"), device=h.device)   # running max of each row's logits
        l_i = torch.zeros(h.shape[0], device=h.device)                    # running sum of exp(logit - m_i)
        t_i = torch.zeros(h.shape[0], device=h.device)                    # the target's logit, once its tile passes
        for v0 in range(0, V, block_v):
            logits = h @ weight[v0:v0 + block_v].float().T          # (block_m, block_v): the only logits alive
            m_new = torch.maximum(m_i, logits.amax(dim=1))
            l_i = l_i * torch.exp(m_i - m_new) + torch.exp(logits - m_new[:, None]).sum(dim=1)
            m_i = m_new
            cols = torch.arange(v0, v0 + logits.shape[1], device=h.device)
            t_i += torch.where(cols[None, :] == t[:, None], logits, 0.0).sum(dim=1)
        lse[r0:r0 + block_m], tgt[r0:r0 + block_m] = m_i + torch.log(l_i), t_i
    return lse, tgt


def cross_entropy_kernel(H, W, T, LSE, TGT, N, V, D, stride_h, stride_w,
                         BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Per row: log-sum-exp of hidden @ weight.T over the vocabulary, and the target's logit.
    One program per BLOCK_M rows; vocabulary tiles stream through with a running max and sum.
    The Triton kernel behind `triton_lse_and_target`; `online_lse_and_target` is its twin."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    t = tl.load(T + rows, mask=row_ok, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)     # running max of each row's logits
    l_i = tl.zeros([BLOCK_M], tl.float32)                   # running sum of exp(logit - m_i)
    tgt = tl.zeros([BLOCK_M], tl.float32)                   # the target's logit, once its tile passes
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        logits = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for d0 in range(0, D, BLOCK_D):                     # one (BLOCK_M, BLOCK_V) tile of logits
            ds = d0 + tl.arange(0, BLOCK_D)
            h = tl.load(H + rows[:, None] * stride_h + ds[None, :], mask=row_ok[:, None] & (ds[None, :] < D), other=0.0)
            w = tl.load(W + cols[:, None] * stride_w + ds[None, :], mask=(cols[:, None] < V) & (ds[None, :] < D), other=0.0)
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            logits = tl.dot(h, tl.trans(w), logits, input_precision="ieee")
        logits = tl.where(cols[None, :] < V, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), 1)
        m_i = m_new
        tgt += tl.sum(tl.where(cols[None, :] == t[:, None], logits, 0.0), 1)
    tl.store(LSE + rows, m_i + tl.log(l_i), mask=row_ok)
    tl.store(TGT + rows, tgt, mask=row_ok)


def triton_lse_and_target(hidden, weight, targets, block_m=16, block_v=64, block_d=32):
    """`online_lse_and_target` by the Triton kernel `cross_entropy_kernel` (needs triton)."""
    check_ce_args(hidden, weight, targets)
    for name, v in (("block_m", block_m), ("block_v", block_v), ("block_d", block_d)):
        power_of_two(name, v, 16, TILE)
    triton, kernels = _jitted()
    N, D = hidden.shape
    V = weight.shape[0]
    hidden, weight = hidden.contiguous(), weight.contiguous()
    lse = torch.empty(N, device=hidden.device, dtype=torch.float32)
    tgt = torch.empty(N, device=hidden.device, dtype=torch.float32)
    kernels["cross_entropy"][(triton.cdiv(N, block_m),)](
        hidden, weight, targets.contiguous(), lse, tgt, N, V, D, hidden.stride(0), weight.stride(0),
        BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_D=block_d, UPCAST=interpreted() and hidden.dtype != torch.float32)
    return lse, tgt


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of hidden @ weight.T; saves hidden, weight, targets and the (N,) log-sum-exp."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, ignore_index, forward, block_v):
        if forward == "chunked":
            lse, tgt = chunked_lse_and_target(hidden, weight, targets, chunk)
        elif forward == "online":
            lse, tgt = online_lse_and_target(hidden, weight, targets, block_m=chunk, block_v=block_v)
        else:
            lse, tgt = triton_lse_and_target(hidden, weight, targets, block_v=block_v)
        keep = targets != ignore_index
        count = keep.sum()
        loss = torch.where(keep, lse - tgt, 0.0).sum() / count
        ctx.save_for_backward(hidden, weight, targets, lse, keep, count)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse, keep, count = ctx.saved_tensors
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        scale = (grad_loss / count).float()
        safe = targets.clamp(min=0)
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            p = torch.exp((h @ weight.T).float() - lse[s:s + ctx.chunk, None])   # softmax, recomputed
            p[torch.arange(p.shape[0], device=p.device), safe[s:s + ctx.chunk]] -= 1.0
            p *= keep[s:s + ctx.chunk, None] * scale                              # d loss / d logits
            if grad_h is not None:
                grad_h[s:s + ctx.chunk] = (p.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                torch.addmm(grad_w, p.T, h.float(), out=grad_w)        # in place, no (V, D) temporary; FlopCounterMode
                                                                       # counts addmm(out=), not addmm_
            del p
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None


def linear_cross_entropy(hidden, weight, targets, chunk=256, ignore_index=-100, forward="chunked", block_v=64):
    """F.cross_entropy(hidden @ weight.T, targets) (mean over targets != ignore_index), forward and
    backward, holding at most `chunk` rows of logits at a time.

    hidden (N, D), weight (V, D) (an LM head's weight), targets (N,) int64. forward: one of FORWARDS,
    "chunked" (chunk x V logits at a time), "online" (chunk x block_v: the fused kernel's algorithm in
    PyTorch) or "triton" (the fused kernel, 16 x block_v tiles in registers; needs triton). Backward is
    the same for all three: the logits recomputed `chunk` rows at a time."""
    check_ce_args(hidden, weight, targets, chunk=chunk, block_v=block_v)
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    if forward == "triton":
        power_of_two("block_v", block_v, 16, " for forward='triton' (a tl.dot tile)")
        _jitted()                                           # says what is missing before any work
    return LinearCrossEntropy.apply(hidden, weight, targets, chunk, ignore_index, forward, block_v)
