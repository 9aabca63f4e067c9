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


def test_eager_faults_come_from_malloc_giving_its_heap_back(monkeypatch):
    """Notebook 11 prints thousands of page faults per eager call at its default malloc: after each call the
    freed tensors leave glibc's heap top free, past its trim threshold, and free() hands those pages back (and
    blocks above the mmap threshold are unmapped). With neither (a 32 MiB mmap threshold, an unreachable trim
    threshold) the same calls fault almost no pages."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    plain = engines.run("eager", model="resnet-tiny", batch=8, image=128, repeat=5)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(2**40))          # engines.run passes the environment on
    kept = engines.run("eager", model="resnet-tiny", batch=8, image=128, repeat=5, malloc_mmap_threshold=2**25)
    assert sorted(plain.faults)[2] > 200 and sorted(kept.faults)[2] < 50, (plain.faults, kept.faults)
