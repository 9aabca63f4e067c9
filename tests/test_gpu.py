"""GPU-only checks, run by `make test-gpu`: the tracker against the CUDA caching allocator."""
import pytest
import torch

import labkit as lk
from conftest import steady_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_track_matches_max_memory_allocated(dtype):
    model = lk.models.build("llama-2-7b", "tiny", dtype=dtype, device="cuda", num_hidden_layers=8,
                            hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    step = steady_step(model, opt, next(lk.data.batches(8, 512, device="cuda")))
    lk.free()
    with lk.track(model, opt, device="cuda") as mem:
        step()
    allocator_peak = mem.cuda["peak_allocated"] - mem.cuda["allocated_start"] + mem.start
    assert mem.peak == pytest.approx(allocator_peak, rel=0.05)


def test_budget_raises_a_real_cuda_oom():
    with lk.oom_guard() as guard:
        with lk.budget("256 MiB"):
            x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    assert guard.oom
    y = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")   # the fraction is restored
    del y


def test_snapshot_file(tmp_path):
    path = tmp_path / "snap.pickle"
    with lk.track(snapshot=path) as mem:
        x = torch.ones(1024, 1024, device="cuda")
    assert path.stat().st_size > 0 and mem.cuda["peak_reserved"] >= 4 * 2**20
