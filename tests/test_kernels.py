"""labkit.kernels: the PyTorch twins (tiled matmul in the kernel's program order, chunked and online
cross-entropy) against torch.matmul and F.cross_entropy, forward and backward, on every machine; the
Triton kernels (interpreted on a CPU) against the same references and against their twins where
triton exists.

Tolerances: fp32 results that differ only in summation order agree to about 1e-6 relative per
summand; 1e-4 (matmul, K up to 96) and 1e-5 (cross-entropy) leave room for that and nothing more.
bf16 outputs carry 8 mantissa bits: 1e-2 relative."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import labkit as lk
from labkit import kernels

needs_triton = pytest.mark.skipif(not lk.has("triton"), reason="needs triton")


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=lk.device()).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=lk.device()).to(dtype)


# ---- the tiled matmul twin ---------------------------------------------------------------------------
@pytest.mark.parametrize("m, n, k, group_m", [(64, 64, 64, 2), (50, 70, 40, 3), (33, 17, 96, 1)])
def test_tiled_matmul_matches_torch(m, n, k, group_m):
    a, b = rand(m, k, seed=1), rand(k, n, seed=2)
    torch.testing.assert_close(kernels.tiled_matmul(a, b, block_m=16, block_n=32, block_k=16, group_m=group_m),
                               a @ b, rtol=1e-4, atol=1e-4)


def test_tiled_matmul_bf16_and_strided_input():
    a, b = rand(64, 32, dtype=torch.bfloat16, seed=3), rand(64, 48, dtype=torch.bfloat16, seed=4)
    out = kernels.tiled_matmul(a.T, b)                              # bf16 out, fp32 accumulation
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), a.T.float() @ b.float(), rtol=1e-2, atol=5e-2)


def test_tiled_matmul_runs_programs_in_grouped_order_and_reads_fewer_panels():
    """Triton's tutorial: 9 x 9 tiles, 9 programs at a time: 90 panel reads row-major, 54 grouped."""
    a, b = rand(144, 48, seed=5), rand(48, 144, seed=6)
    counted = {}
    for g in (1, 3):
        reads = []
        kernels.tiled_matmul(a, b, block_m=16, block_n=16, block_k=16, group_m=g, reads=reads)
        assert [pid for pid, _, _ in reads] == list(range(81))
        tiles = [(r[0] // 16, c[0] // 16) for _, r, c in reads]
        assert tiles == [kernels.grouped_pid(p, 9, 9, g) for p in range(81)]
        counted[g] = kernels.panels_read(reads, wave=9)
        assert counted[g] == kernels.blocks_loaded(9, 9, g, wave=9)
    assert counted == {1: 90, 3: 54}


def test_round_to_tf32_keeps_ten_mantissa_bits_rounded_to_nearest():
    x = torch.tensor([1.0, 1 + 2**-10, 1 + 2**-11, 1 + 2**-11 + 2**-20, 1 + 2**-12, -(1 + 2**-11 + 2**-20), 3.0])
    want = torch.tensor([1.0, 1 + 2**-10, 1 + 2**-10, 1 + 2**-10, 1.0, -(1 + 2**-10), 3.0])
    assert torch.equal(kernels.round_to_tf32(x), want)              # ties and above round away from zero
    y = rand(1000, seed=7)
    rel = ((kernels.round_to_tf32(y) - y).abs() / y.abs()).max().item()
    assert 2**-13 < rel <= 2**-11                                   # half a unit in the 10th mantissa bit
    with pytest.raises(TypeError, match="x must be an fp32 tensor"):
        kernels.round_to_tf32(y.double())


def test_tf32_twin_is_far_less_exact_than_fp32():
    """A TF32 matmul of full-mantissa inputs errs about 2^-11 per product; fp32 about 2^-24."""
    a, b = rand(128, 128, seed=8), rand(128, 128, seed=9)
    exact = a.double() @ b.double()
    err = {p: ((kernels.tiled_matmul(a, b, precision=p).double() - exact).abs().max() / exact.abs().max()).item()
           for p in ("ieee", "tf32")}
    assert err["tf32"] > 100 * err["ieee"] and err["tf32"] < 1e-2


@pytest.mark.parametrize("num_m, num_n, group_m", [(9, 9, 3), (5, 7, 2), (4, 3, 8), (6, 6, 1)])
def test_grouped_pid_is_a_permutation_in_column_groups(num_m, num_n, group_m):
    tiles = [kernels.grouped_pid(p, num_m, num_n, group_m) for p in range(num_m * num_n)]
    assert sorted(tiles) == [(i, j) for i in range(num_m) for j in range(num_n)]
    if group_m == 1:
        assert tiles == [(i, j) for i in range(num_m) for j in range(num_n)]      # row-major
    else:   # the first programs walk down a group of rows before moving right
        assert tiles[:2] == [(0, 0), (1, 0)]


def test_matmul_twin_bad_input():
    x = torch.zeros(16, 16)
    with pytest.raises(ValueError, match="inner dimensions"):
        kernels.tiled_matmul(x, torch.zeros(8, 16))
    with pytest.raises(ValueError, match="2-D"):
        kernels.tiled_matmul(torch.zeros(2, 16, 16), x)
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.tiled_matmul(x, x.double())
    with pytest.raises(ValueError, match="precision must be one of"):
        kernels.tiled_matmul(x, x, precision="fp64")
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16 .*got 24"):
        kernels.tiled_matmul(x, x, block_k=24)
    with pytest.raises(TypeError, match="reads must be a list"):
        kernels.tiled_matmul(x, x, reads=set())
    with pytest.raises(ValueError, match="reads must be the non-empty list"):
        kernels.panels_read([], wave=2)
    with pytest.raises(ValueError, match="pid must be below"):
        kernels.grouped_pid(12, 3, 4, 2)
    with pytest.raises(ValueError, match="group_m must be .*, got 0"):
        kernels.grouped_pid(0, 3, 4, 0)
    with pytest.raises(ValueError, match="wave must be .*, got 0"):
        kernels.blocks_loaded(3, 3, 1, wave=0)


# ---- the Triton matmul, against torch and its twin -------------------------------------------------
@needs_triton
@pytest.mark.parametrize("m, n, k, group_m", [(64, 64, 64, 2), (50, 70, 40, 3), (33, 17, 96, 1)])
def test_triton_matmul_matches_torch_and_its_twin(m, n, k, group_m):
    a, b = rand(m, k, seed=1), rand(k, n, seed=2)
    out = kernels.matmul(a, b, group_m=group_m)
    torch.testing.assert_close(out, a @ b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, kernels.tiled_matmul(a, b, group_m=group_m), rtol=1e-4, atol=1e-4)


@needs_triton
def test_triton_matmul_bf16_and_strided_input():
    a, b = rand(64, 32, dtype=torch.bfloat16, seed=3), rand(64, 48, dtype=torch.bfloat16, seed=4)
    out = kernels.matmul(a.T.contiguous(), b)                       # bf16 out, fp32 accumulation
    torch.testing.assert_close(out.float(), a.T.float() @ b.float(), rtol=1e-2, atol=5e-2)
    x = rand(64, 64, seed=5)
    torch.testing.assert_close(kernels.matmul(x.T, x), x.T @ x, rtol=1e-4, atol=1e-4)   # non-contiguous a


@needs_triton
def test_triton_matmul_bad_input():
    x = torch.zeros(16, 16)
    with pytest.raises(ValueError, match="inner dimensions"):
        kernels.matmul(x, torch.zeros(8, 16))
    with pytest.raises(ValueError, match="precision must be one of"):
        kernels.matmul(x, x, precision="fp64")


# ---- cross-entropy -----------------------------------------------------------------------------------
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


def test_reference_is_f_cross_entropy():
    h, w, t = ce_inputs()
    logits = (h @ w.T).detach().requires_grad_()
    want = torch.nn.functional.cross_entropy(logits, t)
    want.backward()
    got = grads(kernels.cross_entropy_reference, h, w, t)
    torch.testing.assert_close(got[0], want.detach())
    torch.testing.assert_close(got[1], logits.grad @ w.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("forward, chunk", [("chunked", 1), ("chunked", 16), ("chunked", 1000),
                                            ("online", 16), ("online", 64)])
def test_cross_entropy_without_logits_matches_f_cross_entropy_forward_and_backward(forward, chunk):
    h, w, t = ce_inputs()
    ref = grads(kernels.cross_entropy_reference, h, w, t)
    got = grads(lambda *a: kernels.linear_cross_entropy(*a, chunk=chunk, forward=forward, block_v=64), h, w, t)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block_m, block_v", [(16, 64), (7, 33), (128, 1000)])
def test_online_forward_gives_each_rows_log_sum_exp_and_target_logit(block_m, block_v):
    h, w, t = ce_inputs()
    t = t.clamp(min=0)
    logits = (h @ w.T).detach()
    lse, tgt = kernels.online_lse_and_target(h.detach(), w.detach(), t, block_m=block_m, block_v=block_v)
    torch.testing.assert_close(lse, torch.logsumexp(logits, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tgt, logits.gather(1, t[:, None])[:, 0], rtol=1e-5, atol=1e-5)


def test_online_forward_holds_one_tile_of_logits():
    """The chunked forward holds chunk x V logits (and their exp); the online one a block_m x block_v tile."""
    n, d, v = 256, 32, 4096
    h, w, t = (x.detach() for x in ce_inputs(n, d, v))
    t = t.clamp(min=0)
    with lk.track() as chunked:
        kernels.chunked_lse_and_target(h, w, t, chunk=64)
    with lk.track() as online:
        kernels.online_lse_and_target(h, w, t, block_m=64, block_v=256)
    assert chunked.peak - chunked.start >= 64 * v * 4                 # one chunk of fp32 logits
    assert online.peak - online.start <= 4 * 64 * 256 * 4 + 4 * n * 4 + 4096   # a few tiles, lse and tgt


@needs_triton
def test_triton_cross_entropy_matches_reference_and_its_twin():
    h, w, t = ce_inputs(n=40, d=32, v=200)
    ref = grads(kernels.cross_entropy_reference, h, w, t)
    got = grads(lambda *a: kernels.linear_cross_entropy(*a, chunk=16, forward="triton"), h, w, t)
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    safe = t.clamp(min=0)
    fused = kernels.triton_lse_and_target(h.detach(), w.detach(), safe)
    twin = kernels.online_lse_and_target(h.detach(), w.detach(), safe, block_m=16, block_v=64)
    for f, tw in zip(fused, twin):
        torch.testing.assert_close(f, tw, rtol=1e-5, atol=1e-5)


def test_without_triton_the_triton_forward_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(kernels, "has", lambda name: name != "triton")
    monkeypatch.setattr(kernels, "_JITTED", {})                       # as if no kernel had run yet
    h, w, t = ce_inputs(16, 16, 32)
    with pytest.raises(ImportError, match="need triton .* twins"):
        kernels.linear_cross_entropy(h, w, t, forward="triton")
    with pytest.raises(ImportError, match="need triton"):
        kernels.matmul(torch.zeros(16, 16), torch.zeros(16, 16))
    kernels.linear_cross_entropy(h, w, t, forward="online")           # the twin needs no triton


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
    with pytest.raises(ValueError, match="chunk must be .*, got 0"):
        kernels.linear_cross_entropy(h, w, t, chunk=0)
    with pytest.raises(ValueError, match="hidden must be a 2-D"):
        kernels.linear_cross_entropy(h[None], w, t)
    with pytest.raises(ValueError, match="forward must be one of .*got 'fused'"):
        kernels.linear_cross_entropy(h, w, t, forward="fused")
    with pytest.raises(ValueError, match="block_v must be .*, got 0"):
        kernels.linear_cross_entropy(h, w, t, forward="online", block_v=0)
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16 for forward='triton'.*got 48"):
        kernels.linear_cross_entropy(h, w, t, forward="triton", block_v=48)


def test_the_forward_functions_check_their_input_before_any_work():
    h, w, t = ce_inputs(16, 16, 32)
    with pytest.raises(ValueError, match="chunk must be .*, got 0"):
        kernels.chunked_lse_and_target(h, w, t, chunk=0)
    with pytest.raises(ValueError, match="targets must be an int64"):
        kernels.chunked_lse_and_target(h, w, t.float())
    with pytest.raises(ValueError, match="block_m must be .*, got 0"):
        kernels.online_lse_and_target(h, w, t, block_m=0)
    with pytest.raises(ValueError, match="block_v must be .*, got -4"):
        kernels.online_lse_and_target(h, w, t, block_v=-4)
    with pytest.raises(ValueError, match="weight must be a \\(vocab, 16\\)"):
        kernels.online_lse_and_target(h, w.T, t)
    with pytest.raises(ValueError, match="wave must be .*, got True"):
        kernels.blocks_loaded(3, 3, 1, wave=True)


def test_importing_kernels_imports_no_triton():
    import subprocess
    import sys
    code = "import sys, labkit.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_triton
@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs where there is no GPU")
def test_an_older_interpreter_reads_loop_bounds_under_a_newer_numpy(monkeypatch):
    """Triton 3.6 (the GPU image's) reads a scalar kernel argument with int() of a shape-(1,) array, which NumPy
    2.4 and later refuse: every loop over K failed in the interpreter. Stood in for here by that line of 3.6."""
    import numpy as np
    from triton.runtime import interpreter
    kernels.interpreted()                                 # triton imported, its kernels jitted
    current = interpreter._patch_lang_tensor

    def triton_3_6(tensor, scope):
        current(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", triton_3_6)
    a, b = torch.randn(40, 50), torch.randn(50, 24)
    try:
        int(np.array([1]))
    except TypeError:                                     # this NumPy refuses: the failure first
        with pytest.raises(Exception, match="0-dimensional"):
            kernels.matmul(a, b)
        assert kernels._squeeze_interpreter_scalars() is True
        assert kernels._squeeze_interpreter_scalars() is False            # once
    torch.testing.assert_close(kernels.matmul(a, b), a @ b, rtol=1e-4, atol=1e-4)


def test_interpreted_exactly_when_there_is_no_gpu():
    assert kernels.interpreted() is (not torch.cuda.is_available())


def test_cublas_precision_switches_tf32_through_one_api_and_restores():
    """Defect 3 of issue 36: TF32 set through torch.backends.cuda.matmul.fp32_precision alone leaves the legacy
    flag that cuBLASLt's paths read in a mixed state, and reading it then raises. cublas_precision sets both
    through torch.set_float32_matmul_precision; on a CPU the flags still move, so the switch is checked here."""
    before = torch.get_float32_matmul_precision()
    with kernels.cublas_precision("tf32"):
        assert torch.backends.cuda.matmul.allow_tf32 is True                    # the legacy flag, readable
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"              # the new one agrees
    assert torch.get_float32_matmul_precision() == before
    with kernels.cublas_precision("ieee"):
        assert torch.backends.cuda.matmul.allow_tf32 is False
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    with pytest.raises(RuntimeError), kernels.cublas_precision("tf32"):
        raise RuntimeError("a failing matmul")
    assert torch.get_float32_matmul_precision() == before                       # restored on an error too
    assert torch.backends.cuda.matmul.allow_tf32 is (before != "highest")
    with pytest.raises(ValueError, match="precision must be one of .*got 'fp32'"):
        with kernels.cublas_precision("fp32"):
            pass


def test_the_code_notebook_12_shows_calls_only_public_names():
    """What a notebook shows with lk.show is what it teaches: no private labkit helper inside it."""
    import inspect
    import re
    from labkit import profiling
    shown = [profiling.run, kernels.matmul_kernel, kernels.tiled_matmul, kernels.LinearCrossEntropy,
             kernels.cross_entropy_kernel, kernels.online_lse_and_target]
    for obj in shown:
        source = inspect.getsource(obj)
        private = re.findall(r"(?<![\w.])_[a-z]\w*\(", source)
        assert not private, (obj.__name__, private)
