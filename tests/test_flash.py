"""The Triton FlashAttention kernel, under Triton's interpreter on a CPU (compiled on a GPU)."""
import pytest
import torch
import torch.nn.functional as F

import labkit as lk

pytestmark = pytest.mark.skipif(not lk.has("triton"), reason="needs triton")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n", [64, 77])
def test_matches_sdpa(causal, dtype, atol, n):
    from labkit.flash import flash_attention
    device = lk.device()
    g = torch.Generator(device=device).manual_seed(n)
    q, k, v = (torch.randn(2, 2, n, 32, generator=g, device=device).to(dtype) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    # bf16: the output is rounded to 8 mantissa bits (|o| up to ~3, so steps of ~1e-2)
    torch.testing.assert_close(flash_attention(q, k, v, causal=causal).float(), ref, rtol=1e-3, atol=atol)


def test_bad_shapes():
    from labkit.flash import flash_attention
    x = torch.zeros(1, 1, 8, 32)
    with pytest.raises(ValueError, match="must share one"):
        flash_attention(x, x, torch.zeros(1, 1, 9, 32))
    with pytest.raises(ValueError, match="head dim must be 16, 32, 64 or 128 .*got 48"):
        flash_attention(*(torch.zeros(1, 1, 8, 48),) * 3)
