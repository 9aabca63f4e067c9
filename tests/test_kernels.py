"""labkit.kernels: the blocked Triton matmul (under Triton's interpreter on a CPU) and the cross-entropy
that never builds the logits, each against the plain PyTorch version, forward and backward."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import labkit as lk
from labkit import kernels

needs_triton = pytest.mark.skipif(not kernels.HAVE_TRITON, reason="needs triton")


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=lk.device()).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=lk.device()).to(dtype)


@needs_triton
@pytest.mark.parametrize("m, n, k, group_m", [(64, 64, 64, 2), (50, 70, 40, 3), (33, 17, 96, 1)])
def test_matmul_matches_torch(m, n, k, group_m):
    a, b = rand(m, k, seed=1), rand(k, n, seed=2)
    torch.testing.assert_close(kernels.matmul(a, b, group_m=group_m), a @ b, rtol=1e-4, atol=1e-4)


@needs_triton
def test_matmul_bf16_and_strided_input():
    a, b = rand(64, 32, dtype=torch.bfloat16, seed=3), rand(64, 48, dtype=torch.bfloat16, seed=4)
    out = kernels.matmul(a.T.contiguous(), b)                       # bf16 out, fp32 accumulation
    torch.testing.assert_close(out.float(), a.T.float() @ b.float(), rtol=1e-2, atol=5e-2)
    x = rand(64, 64, seed=5)
    torch.testing.assert_close(kernels.matmul(x.T, x), x.T @ x, rtol=1e-4, atol=1e-4)   # non-contiguous a


@needs_triton
def test_matmul_bad_input():
    x = torch.zeros(16, 16)
    with pytest.raises(ValueError, match="inner dimensions"):
        kernels.matmul(x, torch.zeros(8, 16))
    with pytest.raises(ValueError, match="2-D"):
        kernels.matmul(torch.zeros(2, 16, 16), x)
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.matmul(x, x.double())
    with pytest.raises(ValueError, match="precision must be one of"):
        kernels.matmul(x, x, precision="fp64")
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16 .*got 24"):
        kernels.matmul(x, x, block_k=24)


@pytest.mark.parametrize("num_m, num_n, group_m", [(9, 9, 3), (5, 7, 2), (4, 3, 8), (6, 6, 1)])
def test_grouped_pid_is_a_permutation_in_column_groups(num_m, num_n, group_m):
    tiles = [kernels.grouped_pid(p, num_m, num_n, group_m) for p in range(num_m * num_n)]
    assert sorted(tiles) == [(i, j) for i in range(num_m) for j in range(num_n)]
    if group_m == 1:
        assert tiles == [(i, j) for i in range(num_m) for j in range(num_n)]      # row-major
    else:   # the first programs walk down a group of rows before moving right
        assert tiles[:2] == [(0, 0), (1, 0)]


def test_grouped_order_reads_fewer_panels():
    # Triton's tutorial: 9 x 9 tiles, 9 programs at a time: 90 blocks row-major, 54 grouped
    assert kernels.blocks_loaded(9, 9, 1, wave=9) == 90
    assert kernels.blocks_loaded(9, 9, 3, wave=9) == 54


def test_grouped_pid_bad_input():
    with pytest.raises(ValueError, match="pid must be below"):
        kernels.grouped_pid(12, 3, 4, 2)
    with pytest.raises(ValueError, match="group_m must be a positive int, got 0"):
        kernels.grouped_pid(0, 3, 4, 0)
    with pytest.raises(ValueError, match="wave must be a positive int"):
        kernels.blocks_loaded(3, 3, 1, wave=0)


def ce_inputs(n=70, d=48, v=300, dtype=torch.float32):
    h = rand(n, d, dtype=dtype, seed=6).requires_grad_()
    w = (rand(v, d, seed=7) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(8)).to(lk.device())
    t[3] = t[10] = -100                                               # ignored positions, as HF labels pad
    return h, w, t


def grads(loss_fn, h, w, t):
    h.grad = w.grad = None
    loss = loss_fn(h, w, t)
    loss.backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk", [1, 16, 64, 1000])
def test_chunked_cross_entropy_matches_reference(chunk):
    h, w, t = ce_inputs()
    ref = grads(kernels.cross_entropy_reference, h, w, t)
    got = grads(lambda *a: kernels.linear_cross_entropy(*a, chunk=chunk), h, w, t)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@needs_triton
def test_triton_cross_entropy_matches_reference():
    h, w, t = ce_inputs(n=40, d=32, v=200)
    ref = grads(kernels.cross_entropy_reference, h, w, t)
    got = grads(lambda *a: kernels.linear_cross_entropy(*a, chunk=16, triton=True), h, w, t)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_chunked_cross_entropy_bf16():
    h, w, t = ce_inputs(dtype=torch.bfloat16)
    ref = grads(kernels.cross_entropy_reference, h, w, t)
    got = grads(lambda *a: kernels.linear_cross_entropy(*a, chunk=16), h, w, t)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)          # the loss, in fp32
    for r, g in zip(ref[1:], got[1:]):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-3)


def test_chunked_cross_entropy_memory_and_flops():
    """Never more than two chunks of logits live; one more matmul (the recomputation) than the reference."""
    n, d, v, chunk = 256, 32, 2048, 32
    h, w, t = ce_inputs(n, d, v)
    with lk.track(h, w) as ref_mem:
        kernels.cross_entropy_reference(h, w, t).backward()
    with FlopCounterMode(display=False) as ref_flops:
        kernels.cross_entropy_reference(h, w, t).backward()
    h.grad = w.grad = None
    with lk.track(h, w) as mem:
        kernels.linear_cross_entropy(h, w, t, chunk=chunk).backward()
    with FlopCounterMode(display=False) as flops:
        kernels.linear_cross_entropy(h, w, t, chunk=chunk).backward()
    logits = n * v * 4
    assert ref_mem.peak - ref_mem.start >= 3 * logits                 # log-probs, their grad, the logits' grad
    assert mem.peak - mem.start <= v * d * 4 + n * d * 4 + 2 * chunk * v * 4 + 4096
    assert flops.get_total_flops() * 3 == ref_flops.get_total_flops() * 4 == 3 * 4 * 2 * n * d * v


def test_cross_entropy_bad_input():
    h, w, t = ce_inputs(16, 16, 32)
    with pytest.raises(ValueError, match="weight must be a \\(vocab, 16\\)"):
        kernels.linear_cross_entropy(h, w.T, t)
    with pytest.raises(ValueError, match="targets must be an int64"):
        kernels.linear_cross_entropy(h, w, t.int())
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        kernels.linear_cross_entropy(h, w, t, chunk=0)
    with pytest.raises(ValueError, match="hidden must be a 2-D"):
        kernels.linear_cross_entropy(h[None], w, t)
