"""Notebook 11's claim about MALLOC_MMAP_THRESHOLD_, measured: unmapping every freed block above 64 KiB makes
eager PyTorch, which allocates its tensors on every call, fault in fresh pages on every call. Counted in page
faults (a count, not a time: the latencies are shown in the notebook, never asserted on a CPU)."""
from labkit import engines


def test_unmapping_every_freed_block_costs_eager_page_faults_on_every_call():
    results = engines.compare(["eager", ("eager", {"malloc_mmap_threshold": 65536})], model="resnet-tiny",
                              batch=4, image=128, repeat=3)
    plain, unmapped = results["eager"], results["eager malloc_mmap_threshold=65536"]
    assert plain.malloc_mmap_threshold is None and unmapped.malloc_mmap_threshold == 65536
    # malloc's cache hands the same pages back call after call; unmapped, each large tensor is new pages
    assert unmapped.minor_faults > 4 * max(plain.minor_faults, 3), (plain.minor_faults, unmapped.minor_faults)
    assert unmapped.max_abs_diff == 0.0                   # the same arithmetic, another malloc
