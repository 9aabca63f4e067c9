"""labkit.flash: each algorithm in its two backends, the PyTorch twin and the Triton kernel, against SDPA.

Every test of an algorithm runs once per backend: "torch" (the twin, on every machine) and "triton"
(the kernels, under Triton's interpreter on a CPU, compiled on a GPU; skipped where triton is not
installed). References are SDPA on float64 copies of the same (already rounded) inputs, so every error
below is the implementation's own. Tolerances and their reasons:
- fp32: only the summation order differs (errors about 1e-6 measured here): 1e-5 on a CPU. On a GPU
  1e-4: the kernels multiply fp32 in IEEE fp32 (`input_precision="ieee"`, not Triton's TF32 default),
  but `tl.exp` compiles to the hardware's approximate exp2 (a few ulp), and cuBLAS orders sums its own way.
- bf16 forward: the output is rounded to bf16 once (8 significant bits: half a step is 2^-9 relative;
  |o| up to ~3 here, so steps of ~1e-2), and on a GPU P is rounded to bf16 before P @ V, as in
  FlashAttention-2: rtol 2e-2 with atol 2e-2.
- bf16 backward: at most twice SDPA's own error in bf16 (flash-attn's test criterion), see below.
"""
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit import flash

DEVICE = lk.device()
FP32_TOL = 1e-4 if DEVICE.type == "cuda" else 1e-5
TOL = {torch.float32: dict(rtol=FP32_TOL, atol=FP32_TOL), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not lk.has("triton"), reason="needs triton"))]


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)


def reference(q, k, v, causal=False, sm_scale=None):
    """Dense attention in float64, causal mask aligned bottom-right (SDPA's is_causal aligns top-left)."""
    q, k, v = (t.double() for t in (q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 77])
def test_forward_matches_sdpa(backend, causal, dtype, n):
    q, k, v = (rand(2, 2, n, 32, dtype=dtype, seed=n + i) for i in range(3))
    out = flash.flash_attention(q, k, v, causal=causal, backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), **TOL[dtype])


# (Hq, Hkv, Nq, Nk, causal): multi-head, grouped-query, multi-query, a chunk of queries at the end of
# a longer sequence (bottom-right causal), ragged lengths that are not multiples of the 32-row blocks.
CASES = [(2, 2, 77, 77, False), (2, 2, 77, 77, True), (4, 2, 45, 77, True), (4, 1, 64, 64, True),
         (2, 1, 20, 50, False)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hq, hkv, nq, nk, causal", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_sdpa(backend, hq, hkv, nq, nk, causal, dtype):
    """Gradients against float64 SDPA. In bf16, flash-attn's own criterion: each error at most twice
    SDPA's own error in bf16 (both round O, and the gradients, to bf16; O's rounding enters D = rowsum(dO * O))."""
    q = rand(1, hq, nq, 32, dtype=dtype, seed=1).requires_grad_()
    k = rand(1, hkv, nk, 32, dtype=dtype, seed=2).requires_grad_()
    v = rand(1, hkv, nk, 32, dtype=dtype, seed=3).requires_grad_()
    do = rand(1, hq, nq, 32, dtype=dtype, seed=4)
    out = flash.flash_attention(q, k, v, causal=causal, sm_scale=0.3, backend=backend)
    out.backward(do)
    mine = [out] + [t.grad for t in (q, k, v)]
    assert all(g is not None and g.dtype == dtype for g in mine), "every input gets a gradient in its dtype"

    def sdpa_grads(cast):
        xs = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        o = reference(*xs, causal=causal, sm_scale=0.3).to(cast)
        o.backward(do.to(cast))
        return [o.double()] + [x.grad.double() for x in xs]

    exact = sdpa_grads(torch.float64)
    if dtype == torch.float32:
        for name, a, b in zip(["o", "dq", "dk", "dv"], mine, exact):
            torch.testing.assert_close(a.double(), b, **TOL[dtype], msg=lambda m: f"{name}: {m}")
    else:
        theirs = sdpa_grads(dtype)
        for name, a, t, b in zip(["o", "dq", "dk", "dv"], mine, theirs, exact):
            err, sdpa_err = (a.double() - b).abs().max().item(), (t - b).abs().max().item()
            assert err <= 2 * sdpa_err + 1e-3, f"{name}: error {err:.2e}, SDPA's own bf16 error {sdpa_err:.2e}"


@pytest.mark.skipif(not lk.has("triton"), reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_its_twin_forward_backward_and_lse(dtype):
    """The Triton kernels against the PyTorch twins on one GQA, causal, ragged case: the same algorithm,
    so fp32 agrees to summation order; in bf16 the kernels on a GPU round P to bf16 before P @ V (the twin
    keeps fp32), hence bf16's tolerance."""
    xs = [rand(1, 4, 45, 32, dtype=dtype, seed=1), rand(1, 2, 77, 32, dtype=dtype, seed=2),
          rand(1, 2, 77, 32, dtype=dtype, seed=3)]
    do = rand(1, 4, 45, 32, dtype=dtype, seed=4)
    got = {}
    for backend in ("torch", "triton"):
        q, k, v = (t.clone().requires_grad_() for t in xs)
        o, lse = flash.flash_attention(q, k, v, causal=True, return_lse=True, backend=backend)
        o.backward(do)
        got[backend] = [o, lse, q.grad, k.grad, v.grad]
    for name, a, b in zip(["o", "lse", "dq", "dk", "dv"], got["triton"], got["torch"]):
        torch.testing.assert_close(a.float(), b.float(), **TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_flow_and_only_o_and_lse_are_held(backend):
    B, H, N, D = 1, 2, 40, 32
    q, k, v = (rand(B, H, N, D, seed=i).requires_grad_() for i in range(3))
    with lk.track() as mem:
        out = flash.flash_attention(q, k, v, backend=backend)
    assert out.grad_fn is not None, "inputs that require grad get a graph"
    assert mem.live == B * H * N * D * 4 + B * H * N * 4, "O and the fp32 log-sum-exp, nothing N x N"
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))
    with torch.no_grad():
        assert flash.flash_attention(q, k, v, backend=backend).grad_fn is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_is_the_rows_logsumexp(backend):
    q, k, v = (rand(1, 2, 50, 16, seed=i) for i in range(3))
    _, lse = flash.flash_attention(q, k, v, causal=True, sm_scale=0.5, return_lse=True, backend=backend)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.5
    s = s.masked_fill(~torch.ones(50, 50, dtype=torch.bool, device=DEVICE).tril(), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=FP32_TOL, atol=FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sm_scale_default_is_one_over_sqrt_d(backend):
    q, k, v = (rand(1, 1, 33, 64, seed=i) for i in range(3))
    default = flash.flash_attention(q, k, v, backend=backend)
    torch.testing.assert_close(default, flash.flash_attention(q, k, v, sm_scale=1 / math.sqrt(64), backend=backend))
    assert not torch.allclose(default, flash.flash_attention(q, k, v, sm_scale=1.0, backend=backend), atol=1e-3)


def test_online_softmax_step_over_two_tiles_equals_one_softmax():
    """The update folded over two tiles of keys gives softmax(s) @ v over all of them (exactly the
    algebra of the lesson: rescaling by exp(m - m') makes the order of tiles irrelevant)."""
    s, v = rand(3, 10, seed=1).double(), rand(10, 4, seed=2).double()
    m, l, acc = torch.full((3,), float("-inf"), dtype=torch.float64), torch.zeros(3, dtype=torch.float64), \
        torch.zeros(3, 4, dtype=torch.float64)
    for cols in (slice(6, 10), slice(0, 6)):                    # any order
        m, l, acc = flash.online_softmax_step(m, l, acc, s[:, cols], v[cols])
    torch.testing.assert_close(acc / l[:, None], torch.softmax(s, -1) @ v)
    torch.testing.assert_close(m + l.log(), torch.logsumexp(s, -1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nk, splits", [(200, 4), (200, 1), (70, 8)])
def test_flash_decode_matches_dense(backend, dtype, nk, splits):
    q = rand(2, 4, 1, 32, dtype=dtype, seed=5)
    k, v = rand(2, 2, nk, 32, dtype=dtype, seed=6), rand(2, 2, nk, 32, dtype=dtype, seed=7)
    out, o_parts, lse_parts = flash.flash_decode(q, k, v, num_splits=splits, return_parts=True, backend=backend)
    assert o_parts.shape[2] == lse_parts.shape[2] == min(splits, -(-nk // 32))   # no empty split
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v), **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_splits_merges_disjoint_key_sets(backend):
    """Attention over keys [0, 40) and [40, 100), computed apart, combines into attention over all."""
    q, k, v = rand(1, 2, 16, 32, seed=1), rand(1, 2, 100, 32, seed=2), rand(1, 2, 100, 32, seed=3)
    parts = [flash.flash_attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True, backend=backend)
             for a, b in ((0, 40), (40, 100))]
    o, lse = flash.combine_splits(torch.stack([p[0] for p in parts], -2), torch.stack([p[1] for p in parts], -1))
    full, full_lse = flash.flash_attention(q, k, v, return_lse=True, backend=backend)
    torch.testing.assert_close(o, full, rtol=FP32_TOL, atol=FP32_TOL)
    torch.testing.assert_close(lse, full_lse, rtol=FP32_TOL, atol=FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense(backend, dtype):
    """Sequences scattered over a shuffled block pool, one sharing another's first blocks (a fork)."""
    bs, hq, hkv, d, lens = 16, 4, 2, 32, [37, 16, 1, 50]
    k_cache, v_cache = rand(24, bs, hkv, d, dtype=dtype, seed=8), rand(24, bs, hkv, d, dtype=dtype, seed=9)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0)).tolist()
    table = torch.full((4, 4), 99, dtype=torch.int32)        # entries past a sequence's length: ignored
    table[0, :3], table[1, :1], table[2, :1] = torch.tensor(order[:3], dtype=torch.int32), order[3], order[4]
    table[3, :2], table[3, 2:4] = table[0, :2], torch.tensor(order[5:7], dtype=torch.int32)   # shares seq 0's first two
    q = rand(4, hq, d, dtype=dtype, seed=10)
    out = flash.paged_attention(q, k_cache, v_cache, table.to(DEVICE), torch.tensor(lens, device=DEVICE), backend=backend)
    for b, n in enumerate(lens):
        blocks = table[b, :-(-n // bs)].long().to(DEVICE)
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]      # (1, Hkv, n, d)
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        ref = reference(q[b][None, :, None], k, v)[0, :, 0]
        torch.testing.assert_close(out[b].double(), ref, **TOL[dtype])


def test_kernel_source_reads_the_triton_file_without_importing_triton():
    src = flash.kernel_source("forward")
    assert src.startswith("@triton.jit\ndef flash_fwd_kernel(") and "= online_softmax(m_i, l_i, s)" in src
    with pytest.raises(ValueError, match="name must be one of .*got 'fwd'"):
        flash.kernel_source("fwd")


def test_the_online_softmax_is_written_once_in_triton_and_every_kernel_calls_it():
    """One @triton.jit helper beside its PyTorch twin: the update's lines appear in it alone."""
    helper = flash.kernel_source("online_softmax")
    assert helper.startswith("@triton.jit\ndef online_softmax(m_i, l_i, s):")
    text = (pathlib.Path(flash.__file__).parent / "flash_triton.py").read_text()
    assert text.count("tl.exp(m_i - m_new)") == 1 and text.count("tl.maximum(m_i, tl.max(s, 1))") == 1
    for name in ("forward", "decode", "paged"):
        body = flash.kernel_source(name)
        assert "online_softmax(" in body or "_fold_keys(" in body, name


def test_each_tile_is_loaded_in_one_place():
    """Every kernel that walks K and V in tiles loads them through `load_kv_tile` (the paged kernel reads
    through a block table, its own layout), as Triton's tutorial keeps its key loop in one inner function;
    both backward kernels read their rows of Q, dO, lse and D through `load_q_tile`."""
    text = (pathlib.Path(flash.__file__).parent / "flash_triton.py").read_text()
    assert text.count("tl.load(K + ") == 1 and text.count("tl.load(V + ") == 1 and text.count("tl.load(DO + ") == 1
    for name in ("forward", "backward_dkdv", "backward_dq", "decode"):
        assert "load_kv_tile(K, V, " in flash.kernel_source(name), name
    for name in ("backward_dkdv", "backward_dq"):
        assert "load_q_tile(Q, DO, LSE, DELTA, " in flash.kernel_source(name), name


@pytest.mark.parametrize("name", sorted(flash.KERNELS))
def test_kernel_code_shows_the_kernel_from_its_file_without_triton(name):
    """lk.show(flash.kernel_code(name)) shows exactly the lines kernel_source reads, decorator first."""
    from labkit.show import source
    assert source(flash.kernel_code(name)) == flash.kernel_source(name)


def test_hbm_traffic_of_both_algorithms_is_the_papers_count_and_the_output_is_right():
    """Counted at each block load and store: Algorithm 0 moves 4N^2 + 4Nd elements, Algorithm 1
    2Nd + T_c (3Nd + 4N) with T_c = ceil(N / ceil(M / 4d)); both outputs equal softmax(q k^T / sqrt d) v."""
    g = torch.Generator().manual_seed(0)
    N, d = 200, 32                                              # ragged: the last blocks are partial
    q, k, v = (torch.randn(N, d, generator=g) for _ in range(3))
    ref = torch.softmax(q @ k.T / math.sqrt(d), -1) @ v
    standard = flash.HBMTraffic()
    torch.testing.assert_close(flash.standard_attention_io(q, k, v, standard), ref, rtol=1e-5, atol=1e-5)
    assert standard.total == (4 * N * N + 4 * N * d) * 4
    assert standard.reads == {"Q": N * d * 4, "K": N * d * 4, "S": N * N * 4, "P": N * N * 4, "V": N * d * 4}
    for M in (d, 1024, 4096, N * d):
        tiled = flash.HBMTraffic()
        torch.testing.assert_close(flash.flash_attention_io(q, k, v, M, tiled), ref, rtol=1e-5, atol=1e-5)
        t_c = -(-N // -(-M // (4 * d)))
        assert tiled.total == (2 * N * d + t_c * (3 * N * d + 4 * N)) * 4, M
        assert tiled.reads["K"] == tiled.reads["V"] == N * d * 4     # each key and value read once


def test_hbm_traffic_refuses_what_the_theorem_excludes():
    q = torch.randn(64, 16)
    with pytest.raises(ValueError, match="sram must be .* d <= sram <= N d .*got 8"):
        flash.flash_attention_io(q, q, q, 8, flash.HBMTraffic())
    with pytest.raises(ValueError, match="q must be a non-empty \\(N, d\\) tensor"):
        flash.standard_attention_io(q[None], q, q, flash.HBMTraffic())


# ---------------------------------------------------------------- bad inputs: refused before any work
X = torch.zeros(1, 2, 8, 32)
CACHE, Q3, TABLE, LENS = torch.zeros(4, 16, 2, 32), torch.zeros(2, 2, 32), torch.zeros(2, 2, dtype=torch.int32), \
    torch.tensor([5, 3])


def attention(**changes):
    return lambda: flash.flash_attention(**{**dict(q=X, k=X, v=X), **changes})


def decode(**changes):
    return lambda: flash.flash_decode(**{**dict(q=X[:, :, :1], k=X, v=X), **changes})


def paged(**changes):
    return lambda: flash.paged_attention(**{**dict(q=Q3, k_cache=CACHE, v_cache=CACHE, block_table=TABLE,
                                                    seq_lens=LENS), **changes})


BAD = [
    (attention(v=torch.zeros(1, 2, 9, 32)), ValueError, "k and v must be"),
    (attention(q=torch.zeros(1, 1, 8, 48), k=torch.zeros(1, 1, 8, 48), v=torch.zeros(1, 1, 8, 48)), ValueError,
     "head dim must be 16, 32, 64 or 128 .*got 48"),
    (attention(k=torch.zeros(1, 3, 8, 32), v=torch.zeros(1, 3, 8, 32)), ValueError, r"q's heads \(2\) must be a multiple .*\(3\)"),
    (attention(k=torch.zeros(1, 2, 4, 32), v=torch.zeros(1, 2, 4, 32), causal=True), ValueError, "needs Nq <= Nk.*Nq=8, Nk=4"),
    (attention(block_m=24), ValueError, "block_m must be a power of two >= 16.*24"),
    (attention(block_n=7), ValueError, "block_n must be a power of two >= 16.*got 7"),
    (attention(block_n=0), ValueError, "block_n must be a power of two >= 16.*got 0"),
    (attention(v=X.bfloat16()), TypeError, "share a dtype"),
    (attention(q=torch.zeros(1, 0, 8, 32)), ValueError, r"q must not be empty.*\(1, 0, 8, 32\)"),
    (attention(q=X.long(), k=X.long(), v=X.long()), TypeError, "q must be float32, float16 or bfloat16, got torch.int64"),
    (attention(k=torch.zeros(1, 2, 0, 32), v=torch.zeros(1, 2, 0, 32)), ValueError, r"k holds no keys \(shape \(1, 2, 0, 32\)\)"),
    (attention(sm_scale="abc"), TypeError, "sm_scale must be a finite number or None.*'abc'"),
    (attention(sm_scale=float("nan")), ValueError, "sm_scale must be a finite number or None.*nan"),
    (attention(q=X.tolist()), TypeError, "q must be a torch.Tensor .*got list"),
    (attention(q=X.to("meta")), ValueError, "q is a meta tensor"),
    (attention(causal="yes"), ValueError, "causal must be True or False, got 'yes'"),
    (attention(backend="cuda"), ValueError, r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
    (decode(q=X), ValueError, "one query per head.*Nq=8"),
    (decode(num_splits=0), ValueError, "num_splits must be .*, got 0"),
    (decode(block_n=7), ValueError, "block_n must be a power of two >= 16.*got 7"),
    (decode(sm_scale="abc"), TypeError, "sm_scale must be a finite number.*'abc'"),
    (decode(q=torch.zeros(1, 0, 1, 32)), ValueError, "q must not be empty"),
    (decode(q=[1.0]), TypeError, "q must be a torch.Tensor .*got list"),
    (decode(k=X.to("meta"), v=X.to("meta")), ValueError, "k is a meta tensor"),
    (decode(q=X[:, :, :1].int(), k=X.int(), v=X.int()), TypeError, "q must be float32, float16 or bfloat16, got torch.int32"),
    (paged(seq_lens=torch.tensor([5, 40])), ValueError, r"seq_lens must lie in \[1, max_blocks \* block_size = 32\], got \[5, 40\]"),
    (paged(block_table=torch.tensor([[0, 1], [7, 0]])), ValueError, "points outside the cache's 4 blocks"),
    (paged(k_cache=torch.zeros(4, 12, 2, 32), v_cache=torch.zeros(4, 12, 2, 32)), ValueError, "block_size must be a power of two.*12"),
    (paged(q=torch.zeros(2, 0, 32)), ValueError, "q must not be empty"),
    (paged(sm_scale="abc"), TypeError, "sm_scale must be a finite number.*'abc'"),
    (paged(q=Q3.tolist()), TypeError, "q must be a torch.Tensor .*got list"),
    (paged(k_cache=CACHE.to("meta"), v_cache=CACHE.to("meta")), ValueError, "k_cache is a meta tensor"),
    (paged(q=Q3.long(), k_cache=CACHE.long(), v_cache=CACHE.long()), TypeError, "q must be float32.*torch.int64"),
    (paged(seq_lens=torch.tensor([5.0, 3.0])), TypeError, "seq_lens must be an int tensor"),
    (paged(block_table=TABLE.to("meta")), ValueError, "block_table is a meta tensor"),
    (paged(block_table=TABLE.tolist()), TypeError, "block_table must be an int tensor .*got list"),
]


@pytest.mark.parametrize("call, error, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_inputs_are_refused_naming_the_argument_and_value(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_triton_backend_without_triton_says_what_to_use(monkeypatch):
    monkeypatch.setattr(flash, "has", lambda name: False if name == "triton" else lk.has(name))
    with pytest.raises(ModuleNotFoundError, match="backend='triton' needs triton.*backend='torch'"):
        flash.flash_attention(X, X, X, backend="triton")
    assert flash.flash_attention(X + 1, X, X, backend="auto").shape == X.shape, "auto falls back to the twin"


@pytest.mark.skipif(not lk.has("triton"), reason="needs triton")
def test_a_kernel_out_of_shared_memory_is_launched_again_with_one_stage():
    """Triton pipelines several stages of K/V tiles; on a GPU with less shared memory the launch raises
    OutOfResources, and the launcher tries once more with one stage (a stand-in kernel, as no CPU runs out)."""
    import triton
    from labkit import flash_triton
    stages = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **consts):
                stages.append(consts.get("num_stages"))
                if "num_stages" not in consts:
                    raise triton.runtime.OutOfResources(232448, 101376, "shared memory")
            return launch

    flash_triton._launch(Kernel(), (1,), "q", D=16)
    assert stages == [None, 1]
