"""The Triton FlashAttention kernels, under Triton's interpreter on a CPU (compiled on a GPU).

References are SDPA on float64 copies of the same (already rounded) inputs, so every error below is the
kernel's own. Tolerances and their reasons:
- fp32 on the interpreter: only the summation order differs (measured errors about 1e-6): 1e-5.
- fp32 on a GPU: Triton's tl.dot computes fp32 inputs in TF32 (10-bit mantissa) by default: 2e-2.
- bf16 forward: the output is rounded to bf16 once (8 significant bits: half a step is 2^-9 relative;
  |o| up to ~3 here, so steps of ~1e-2), and on a GPU P is rounded to bf16 before P @ V, as in
  FlashAttention-2: rtol 2e-2 with atol 2e-2.
- bf16 backward: at most twice SDPA's own error in bf16 (flash-attn's test criterion), see below.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import labkit as lk

pytestmark = pytest.mark.skipif(not lk.has("triton"), reason="needs triton")

DEVICE = lk.device()
FP32_TOL = 2e-2 if DEVICE.type == "cuda" else 1e-5
TOL = {torch.float32: dict(rtol=FP32_TOL, atol=FP32_TOL), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)


def reference(q, k, v, causal=False, sm_scale=None):
    """Dense attention in float64, causal mask aligned bottom-right (SDPA's is_causal aligns top-left)."""
    q, k, v = (t.double() for t in (q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, enable_gqa=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 77])
def test_forward_matches_sdpa(causal, dtype, n):
    from labkit.flash import flash_attention
    q, k, v = (rand(2, 2, n, 32, dtype=dtype, seed=n + i) for i in range(3))
    out = flash_attention(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), **TOL[dtype])


# (Hq, Hkv, Nq, Nk, causal): multi-head, grouped-query, multi-query, a chunk of queries at the end of
# a longer sequence (bottom-right causal), ragged lengths that are not multiples of the 32-row blocks.
CASES = [(2, 2, 77, 77, False), (2, 2, 77, 77, True), (4, 2, 45, 77, True), (4, 1, 64, 64, True),
         (2, 1, 20, 50, False)]


@pytest.mark.parametrize("hq, hkv, nq, nk, causal", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_sdpa(hq, hkv, nq, nk, causal, dtype):
    """Gradients against float64 SDPA. In bf16, flash-attn's own criterion: each error at most twice
    SDPA's own error in bf16 (both round O, and the gradients, to bf16; O's rounding enters D = rowsum(dO * O))."""
    from labkit.flash import flash_attention
    q = rand(1, hq, nq, 32, dtype=dtype, seed=1).requires_grad_()
    k = rand(1, hkv, nk, 32, dtype=dtype, seed=2).requires_grad_()
    v = rand(1, hkv, nk, 32, dtype=dtype, seed=3).requires_grad_()
    do = rand(1, hq, nq, 32, dtype=dtype, seed=4)
    out = flash_attention(q, k, v, causal=causal, sm_scale=0.3)
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


def test_gradients_flow_and_only_o_and_lse_are_held():
    from labkit.flash import flash_attention
    B, H, N, D = 1, 2, 40, 32
    q, k, v = (rand(B, H, N, D, seed=i).requires_grad_() for i in range(3))
    with lk.track() as mem:
        out = flash_attention(q, k, v)
    assert out.grad_fn is not None, "inputs that require grad get a graph"
    assert mem.live == B * H * N * D * 4 + B * H * N * 4, "O and the fp32 log-sum-exp, nothing N x N"
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))
    with torch.no_grad():
        assert flash_attention(q, k, v).grad_fn is None


def test_lse_is_the_rows_logsumexp():
    from labkit.flash import flash_attention
    q, k, v = (rand(1, 2, 50, 16, seed=i) for i in range(3))
    _, lse = flash_attention(q, k, v, causal=True, sm_scale=0.5, return_lse=True)
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.5
    s = s.masked_fill(~torch.ones(50, 50, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)


def test_sm_scale_default_is_one_over_sqrt_d():
    from labkit.flash import flash_attention
    q, k, v = (rand(1, 1, 33, 64, seed=i) for i in range(3))
    torch.testing.assert_close(flash_attention(q, k, v), flash_attention(q, k, v, sm_scale=1 / math.sqrt(64)))
    assert not torch.allclose(flash_attention(q, k, v), flash_attention(q, k, v, sm_scale=1.0), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nk, splits", [(200, 4), (200, 1), (70, 8)])
def test_flash_decode_matches_dense(dtype, nk, splits):
    from labkit.flash import flash_decode
    q = rand(2, 4, 1, 32, dtype=dtype, seed=5)
    k, v = rand(2, 2, nk, 32, dtype=dtype, seed=6), rand(2, 2, nk, 32, dtype=dtype, seed=7)
    out, o_parts, lse_parts = flash_decode(q, k, v, num_splits=splits, return_parts=True)
    assert o_parts.shape[2] == lse_parts.shape[2] == min(splits, -(-nk // 32))   # no empty split
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, k, v), **TOL[dtype])


def test_combine_splits_merges_disjoint_key_sets():
    """Attention over keys [0, 40) and [40, 100), computed apart, combines into attention over all."""
    from labkit.flash import combine_splits, flash_attention
    q, k, v = rand(1, 2, 16, 32, seed=1), rand(1, 2, 100, 32, seed=2), rand(1, 2, 100, 32, seed=3)
    parts = [flash_attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, 40), (40, 100))]
    o, lse = combine_splits(torch.stack([p[0] for p in parts], -2), torch.stack([p[1] for p in parts], -1))
    full, full_lse = flash_attention(q, k, v, return_lse=True)
    torch.testing.assert_close(o, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_dense(dtype):
    """Sequences scattered over a shuffled block pool, one sharing another's first blocks (a fork)."""
    from labkit.flash import paged_attention
    bs, hq, hkv, d, lens = 16, 4, 2, 32, [37, 16, 1, 50]
    k_cache, v_cache = rand(24, bs, hkv, d, dtype=dtype, seed=8), rand(24, bs, hkv, d, dtype=dtype, seed=9)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0)).tolist()
    table = torch.zeros(4, 4, dtype=torch.int32)
    table[0, :3], table[1, :1], table[2, :1] = torch.tensor(order[:3]), order[3], order[4]
    table[3, :2], table[3, 2:4] = table[0, :2], torch.tensor(order[5:7])           # shares seq 0's first two
    q = rand(4, hq, d, dtype=dtype, seed=10)
    out = paged_attention(q, k_cache, v_cache, table.to(DEVICE), torch.tensor(lens, device=DEVICE))
    for b, n in enumerate(lens):
        blocks = table[b, :-(-n // bs)].long().to(DEVICE)
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]      # (1, Hkv, n, d)
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        ref = reference(q[b][None, :, None], k, v)[0, :, 0]
        torch.testing.assert_close(out[b].double(), ref, **TOL[dtype])


def test_bad_inputs():
    from labkit.flash import flash_attention, flash_decode, paged_attention
    x = torch.zeros(1, 2, 8, 32)
    with pytest.raises(ValueError, match="k and v must be"):
        flash_attention(x, x, torch.zeros(1, 2, 9, 32))
    with pytest.raises(ValueError, match="head dim must be 16, 32, 64 or 128 .*got 48"):
        flash_attention(*(torch.zeros(1, 1, 8, 48),) * 3)
    with pytest.raises(ValueError, match=r"q's heads \(2\) must be a multiple .*\(3\)"):
        flash_attention(x, *(torch.zeros(1, 3, 8, 32),) * 2)
    with pytest.raises(ValueError, match="needs Nq <= Nk.*Nq=8, Nk=4"):
        flash_attention(x, *(torch.zeros(1, 2, 4, 32),) * 2, causal=True)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16.*24"):
        flash_attention(x, x, x, block_m=24)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attention(x, x.bfloat16(), x)
    with pytest.raises(ValueError, match="one query per head.*Nq=8"):
        flash_decode(x, x, x)
    with pytest.raises(ValueError, match="num_splits must be a positive int, got 0"):
        flash_decode(x[:, :, :1], x, x, num_splits=0)
    cache, q = torch.zeros(4, 16, 2, 32), torch.zeros(2, 2, 32)
    with pytest.raises(ValueError, match=r"seq_lens must lie in \[1, max_blocks \* block_size = 32\], got \[5, 40\]"):
        paged_attention(q, cache, cache, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([5, 40]))
    with pytest.raises(ValueError, match="points outside the cache's 4 blocks"):
        paged_attention(q, cache, cache, torch.tensor([[0, 1], [7, 0]]), torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="block_size must be a power of two.*12"):
        paged_attention(q, *(torch.zeros(4, 12, 2, 32),) * 2, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([1, 1]))
