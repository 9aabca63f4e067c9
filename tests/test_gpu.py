"""GPU-only checks, run by `make test-gpu` and `make gpu-smoke`: the tracker against the CUDA caching allocator.

The figures each test measures are saved with pytest's `record_property`; `make gpu-smoke` reads them from
its junit report into data/gpu/<gpu>.jsonl (check "test_gpu").
"""
import pytest
import torch

import labkit as lk
from conftest import steady_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make test-gpu)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_track_matches_max_memory_allocated(dtype, record_property):
    """lk.track's peak (exact bytes of live storages) within 5% of the allocator's max_memory_allocated.

    Tolerance: the allocator rounds every block up to a multiple of 512 B (at most 511 B each, a few
    hundred live tensors: under 1 MiB here), and it also counts what kernels allocate for themselves below
    the dispatcher, which lk.track cannot see (SDPA's and cuBLAS's workspaces: tens of MiB at most). The
    step (111M parameters with AdamW, batch 8 x 512: lk.estimate says 4.1 GiB in fp32) peaks at gigabytes, so 5% leaves room for both.
    PyTorch's own MemTracker rounds each storage up to 512 B as the allocator does, so an exact equality
    with it would not hold either."""
    model = lk.models.build("llama-2-7b", "tiny", dtype=dtype, device="cuda", num_hidden_layers=8,
                            hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=8)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    step = steady_step(model, opt, next(lk.data.batches(8, 512, device="cuda")))
    lk.free()
    with lk.track(model, opt, device="cuda") as mem:
        step()
    allocator_peak = mem.cuda["peak_allocated"] - mem.cuda["allocated_start"] + mem.start
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    record_property(f"{name}_track_peak_bytes", mem.peak)
    record_property(f"{name}_allocator_peak_bytes", allocator_peak)
    record_property(f"{name}_track_gap", allocator_peak / mem.peak - 1)
    assert mem.peak == pytest.approx(allocator_peak, rel=0.05)


def test_budget_raises_a_real_cuda_oom(record_property):
    """lk.budget sets a per-process memory fraction: a 512 MiB tensor under a 256 MiB budget is a real CUDA
    OOM. The cache is emptied first: a free cached block of 512 MiB or more (left by an earlier test)
    would be handed out without asking CUDA for memory, and so without checking the fraction."""
    lk.free()
    with lk.oom_guard() as guard:
        with lk.budget("256 MiB"):
            x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    record_property("budget_oom_raised", bool(guard.oom))
    assert guard.oom
    y = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")   # the fraction is restored
    del y


def test_snapshot_file(tmp_path):
    """lk.track(snapshot=path) writes the allocator's snapshot; a 4 MiB tensor makes at least 4 MiB reserved."""
    path = tmp_path / "snap.pickle"
    with lk.track(snapshot=path) as mem:
        x = torch.ones(1024, 1024, device="cuda")
    assert path.stat().st_size > 0 and mem.cuda["peak_reserved"] >= 4 * 2**20
