"""labkit.alloc: the caching-allocator model's rules one by one (and the config PyTorch's parser refuses), its
invariants under random traces, the package's shape, and notebook 05's textbook allocators."""
import copy
import pathlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import labkit as lk
from labkit import alloc
from labkit.alloc import (Allocator, BestFit, Buddy, Config, FirstFit, allocation_size, parse_conf, phases, replay,
                          round_size, smallest_device)
from labkit.units import KiB, MiB

PACKAGE = pathlib.Path(alloc.__file__).parent


# ---- configuration --------------------------------------------------------------------------------
def test_parse_conf_keys_values_and_errors():
    c = parse_conf("max_split_size_mb:64, expandable_segments:True,garbage_collection_threshold:0.6")
    assert (c.max_split_size, c.expandable_segments, c.garbage_collection_threshold) == (64 * MiB, True, 0.6)
    assert parse_conf("") == Config(text="")
    assert parse_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    divs = parse_conf("roundup_power2_divisions:[256:4,512:2,>:1]").roundup_power2_divisions
    assert divs[:9] == (4,) * 9 and divs[9] == 2 and divs[10:] == (1,) * 6
    with pytest.raises(ValueError, match="Unrecognized key 'CUDA_MEMORY_POOL_TYPE'"):
        parse_conf("CUDA_MEMORY_POOL_TYPE:round_robin")
    with pytest.raises(ValueError, match="max_split_size_mb too small"):
        parse_conf("max_split_size_mb:16")
    with pytest.raises(ValueError, match="garbage_collection_threshold must be in"):
        parse_conf("garbage_collection_threshold:1.5")
    with pytest.raises(ValueError, match="expandable_segments must be True or False"):
        parse_conf("expandable_segments:yes")
    with pytest.raises(ValueError, match="power of 2"):
        parse_conf("roundup_power2_divisions:3")
    with pytest.raises(ValueError, match="needs a value"):
        parse_conf("max_split_size_mb")
    with pytest.raises(TypeError, match="conf must be"):
        parse_conf(64)
    with pytest.raises(ValueError, match="fraction needs device"):
        Allocator(fraction=0.5)
    with pytest.raises(ValueError, match="nbytes must be"):
        Allocator().malloc(-1)
    assert parse_conf("release_lock_on_cudamalloc:True") == Config(text="release_lock_on_cudamalloc:True")


@pytest.mark.parametrize("conf, says", [
    ("large_segment_size_mb:10", "large_segment_size_mb must be > 10 MB, got 10"),
    ("large_segment_size_mb:4", "large_segment_size_mb must be > 10 MB, got 4"),
    ("max_split_size_mb:30,large_segment_size_mb:40", r"max_split_size_mb too small, must be >= 40 \(large_segment_size_mb\), got 30"),
    ("large_segment_size_mb:40,max_non_split_rounding_mb:30", "max_non_split_rounding_mb too small, must be >= 40"),
    ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb too small, must be >= 20"),
    ("roundup_power2_divisions:0", "roundup_power2_divisions must be a power of 2 .*got 0"),
    ("max_split_size_mb:[64]", r"max_split_size_mb must be an integer, got \[64\]"),
    ("large_segment_size_mb:[64]", r"large_segment_size_mb must be an integer, got \[64\]"),
    ("per_process_memory_fraction:abc", "per_process_memory_fraction must be a number, got 'abc'"),
])
def test_the_parser_refuses_what_pytorch_refuses(conf, says):
    with pytest.raises(ValueError, match=says):
        parse_conf(conf)


def test_large_segments_set_the_floor_and_the_default_rounding():
    c = parse_conf("max_split_size_mb:32,large_segment_size_mb:32")     # order does not matter: read first
    assert (c.large_segment_size, c.max_split_size, c.max_non_split_rounding) == (32 * MiB, 32 * MiB, 32 * MiB)
    assert parse_conf("roundup_power2_divisions:[256:0,>:4]").roundup_power2_divisions[8] == 0   # 0 inside [...]
    a = Allocator("large_segment_size_mb:11")
    a.malloc(2 * MiB)                                   # a large-pool request below 10 MiB: one 11 MiB segment
    assert a.reserved == 11 * MiB


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(MiB + 1) == MiB + 512
    d4 = parse_conf("roundup_power2_divisions:4")
    assert round_size(1200 * KiB, d4) == 1280 * KiB           # the example in ALLOCATOR.md
    assert round_size(4 * MiB, d4) == 4 * MiB                  # powers of two stay
    assert round_size(5 * MiB + 1, d4) == 6 * MiB
    assert round_size(1000, d4) == 1024                        # <= 512 x d: plain 512-byte rounding
    assert allocation_size(512) == allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB) == 12 * MiB


# ---- the rules --------------------------------------------------------------------------------------
def test_small_requests_share_a_2_mib_segment_large_ones_a_20_mib_one():
    a = Allocator()
    x, y = a.malloc(100), a.malloc(1000)
    assert a.reserved == 2 * MiB and a.allocated == 512 + 1024 and y.ptr == x.ptr + 512
    p, q = a.malloc(5 * MiB), a.malloc(5 * MiB)                 # one 20 MiB segment holds both
    assert a.reserved == 22 * MiB and q.ptr == p.ptr + 5 * MiB and a.device_mallocs == 2
    r = a.malloc(30 * MiB + 1)                                  # its own segment, rounded up to 2 MiB
    assert a.reserved == 22 * MiB + 32 * MiB and r.size == 30 * MiB + 512
    a.check()


def test_large_split_needs_more_than_1_mib_left():
    a = Allocator()
    b = a.malloc(19 * MiB)                                      # 20 MiB segment, 1 MiB left: not split
    assert b.size == 20 * MiB and b.next is None
    c = a.malloc(11 * MiB - 100)                                # 12 MiB segment, ~1 MiB left: not split either
    assert c.size == 12 * MiB


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    a = Allocator()
    big, small = a.malloc(50 * MiB), a.malloc(30 * MiB)
    a.free(big), a.free(small)
    got = a.malloc(25 * MiB)
    assert got.ptr == small.ptr and a.device_mallocs == 2      # from the 30 MiB block, no new malloc
    a.check()


def test_find_free_block_is_best_fit_and_takes_the_block_out_of_the_pool():
    a = Allocator(history=False)
    for size, addr in ((30 * MiB, 3 << 30), (24 * MiB, 2 << 30), (24 * MiB, 1 << 30)):
        a.large.add(alloc.Block(addr, size, small=False))
    got = a.find_free_block(a.large, 22 * MiB)
    assert (got.size, got.ptr) == (24 * MiB, 1 << 30), "the smallest that fits, the lowest address on a tie"
    assert [b.ptr for _, _, b in a.large.blocks] == [2 << 30, 3 << 30]
    assert a.find_free_block(a.large, 40 * MiB) is None


def test_free_coalesces_neighbours_and_empty_cache_keeps_segments_with_live_blocks():
    a = Allocator()
    blocks = [a.malloc(4 * MiB) for _ in range(4)]              # one 20 MiB segment, 4 MiB left over
    for b in (blocks[1], blocks[0], blocks[2]):
        a.free(b)
    free = [b for _, _, b in a.large.blocks]
    assert sorted(b.size for b in free) == [4 * MiB, 12 * MiB]   # 0+1+2 merged; the tail stays apart
    a.empty_cache()
    assert a.reserved == 20 * MiB                               # blocks[3] pins the segment
    a.free(blocks[3])
    a.empty_cache()
    assert a.reserved == 0 and a.device_frees == 1
    a.check()


def test_max_split_size_keeps_oversize_blocks_whole_and_for_large_requests():
    a = Allocator("max_split_size_mb:64")
    b = a.malloc(100 * MiB)
    a.free(b)
    s = a.malloc(30 * MiB)                                      # below max_split: may not take the 100 MiB block
    assert s.ptr != b.ptr and a.reserved == 130 * MiB
    c = a.malloc(90 * MiB)                                      # above: takes it whole, unsplit (10 MiB < 20)
    assert c.ptr == b.ptr and c.size == 100 * MiB
    a.free(c)
    d = a.malloc(70 * MiB)                                      # 30 MiB too large (>= 20 MiB rounding): new segment
    assert d.ptr != b.ptr


def test_max_split_size_keeps_oversize_blocks_from_small_requests():
    a = Allocator("max_split_size_mb:128", history=False)
    a.large.add(alloc.Block(1 << 30, 200 * MiB, small=False))
    assert a.find_free_block(a.large, 30 * MiB) is None, "an oversize block is not handed to a smaller request"
    assert a.find_free_block(a.large, 190 * MiB).size == 200 * MiB, "within max_non_split_rounding (20 MiB)"


def test_out_of_memory_path_frees_cached_segments_then_retries():
    a = Allocator(device=100 * MiB)
    x = a.malloc(60 * MiB)
    a.free(x)                                                   # cached: reserved stays 60 MiB
    y = a.malloc(70 * MiB)                                      # 60 + 70 > 100: release the cache, retry
    assert a.retries == 1 and a.reserved == 70 * MiB and a.device_frees == 1
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 40.00 MiB"):
        a.malloc(40 * MiB)
    assert a.ooms == 1 and a.allocated == y.size
    a.check()


def test_an_oom_trace_entry_records_the_rounded_size():
    a = Allocator(device=20 * MiB, history=True)
    with pytest.raises(torch.OutOfMemoryError):
        a.malloc(30 * MiB + 1)
    oom = [e for e in a.snapshot()["device_traces"][0] if e["action"] == "oom"]
    assert [e["size"] for e in oom] == [30 * MiB + 512]


def test_garbage_collection_threshold_frees_old_segments_before_the_limit():
    """Phases of 12 MiB then 30 MiB tensors under a 500 MiB limit (ALLOCATOR.md's synthetic case). GC runs only
    under a memory fraction below 1.0 (set_memory_fraction sets no limit at 1.0): at 1.0 the threshold changes
    nothing; at 0.999 it frees the first phase's segments before the limit, with no flush-and-retry."""
    trace, key = [], 0
    for size, n in ((12 * MiB, 36), (30 * MiB, 10)):
        for rep in range(3):
            keys = list(range(key, key + n))
            key += n
            trace += [(k, size) for k in keys] + [(k, -size) for k in keys]
    at_one = replay(trace, "garbage_collection_threshold:0.5", device=500 * MiB, fraction=1.0)
    plain = replay(trace, "", device=500 * MiB, fraction=0.999)
    gc = replay(trace, "garbage_collection_threshold:0.5", device=500 * MiB, fraction=0.999)
    assert at_one.allocator.gc_runs == 0 and at_one.peak_reserved == replay(trace, "", device=500 * MiB).peak_reserved
    assert plain.ok and gc.ok
    assert plain.retries >= 1 and gc.retries == 0
    assert gc.peak_reserved < plain.peak_reserved
    assert gc.allocator.gc_runs >= 1


def test_gc_runs_only_under_a_fraction_below_one_on_the_phases_trace():
    trace = phases(500 * MiB)
    default = replay(trace, "", device=500 * MiB)
    at_one = replay(trace, "garbage_collection_threshold:0.5", device=500 * MiB, fraction=1.0)
    below = replay(trace, "garbage_collection_threshold:0.5", device=500 * MiB, fraction=0.999)
    assert at_one.allocator.gc_runs == 0
    assert (at_one.peak_reserved, at_one.retries) == (default.peak_reserved, default.retries)
    assert below.allocator.gc_runs >= 1 and below.peak_reserved < default.peak_reserved and below.retries == 0


def test_memory_fraction_fails_early():
    a = Allocator(device=100 * MiB, fraction=0.5)
    a.malloc(40 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="allowed 50.00 MiB"):
        a.malloc(20 * MiB)


def test_expandable_segments_map_pages_and_grow_in_place():
    a = Allocator("expandable_segments:True")
    x = a.malloc(30 * MiB)
    assert a.reserved == 40 * MiB                               # two 20 MiB pages
    y = a.malloc(30 * MiB)                                      # 10 MiB left mapped + one more page
    assert y.ptr == x.ptr + 30 * MiB and a.reserved == 60 * MiB
    a.free(x), a.free(y)
    a.empty_cache()
    assert a.reserved == 0
    a.check()


def test_growing_batch_default_wastes_expandable_does_not():
    """The note on expandable segments in CUDACachingAllocator.cpp: each larger batch needs new segments."""
    trace, key = [], 0
    for batch in range(8, 17, 2):
        keys = list(range(key, key + 24))
        key += 24
        trace += [(k, batch * 3 * MiB) for k in keys] + [(k, -1) for k in keys]
    default, exp = replay(trace, ""), replay(trace, "expandable_segments:True")
    assert default.peak_allocated == exp.peak_allocated == 24 * 16 * 3 * MiB
    assert default.peak_reserved > default.peak_allocated * 1.1
    assert 0 <= exp.peak_reserved - exp.peak_allocated < 20 * MiB  # at most the last page's unused part


def test_resize_allocates_new_then_frees_old():
    r = replay([(1, 10 * MiB), (1, 20 * MiB), (1, -20 * MiB)], "")
    assert r.peak_allocated == 30 * MiB and r.allocated[-1] == 0


def test_snapshot_is_read_by_memory_viz_offline():
    from torch.cuda import _memory_viz
    a = Allocator()
    keep = [a.malloc(s) for s in (100, 5 * MiB, 30 * MiB)]
    a.free(keep[1])
    snap = a.snapshot()
    text = _memory_viz.segsum(snap)
    assert "segments: 3" in text and "total_reserved: 52.0MiB" in text
    tr = _memory_viz.trace(snap)
    assert "cudaMalloc" in tr and "del " in tr
    e = Allocator("expandable_segments:True")
    x, y, z = (e.malloc(30 * MiB) for _ in range(3))           # pages mapped: 0-40, 40-60, 60-100 MiB
    assert e.reserved == 100 * MiB and y.ptr == x.ptr + 30 * MiB
    e.free(y)                                                   # free 30-60: only the page 40-60 is whole
    e.empty_cache()
    snap = e.snapshot()                                         # one segment per mapped range, as PyTorch reports
    assert [s["total_size"] for s in snap["segments"]] == [40 * MiB, 40 * MiB] and e.reserved == 80 * MiB
    assert all(s["is_expandable"] for s in snap["segments"])
    assert "total_reserved: 80.0MiB" in _memory_viz.segsum(snap)
    e.check()


def test_replay_work_is_one_search_per_allocation_and_smallest_device_bisects():
    import random
    rng, trace, live = random.Random(0), [], []
    for i in range(10_000):
        if live and rng.random() < 0.5:
            trace.append((live.pop(rng.randrange(len(live))), -1))
        else:
            trace.append((i, rng.choice([rng.randint(1, MiB), rng.randint(MiB, 40 * MiB)])))
            live.append(i)
    r = replay(trace, "")
    n_alloc = sum(1 for _, n in trace if n > 0)
    assert r.ok and r.searches == n_alloc and len(r.reserved) == len(trace)
    small = [(k, n) for k, n in trace[:2000]]
    dev = smallest_device(small, "")
    assert replay(small, "", device=dev).ok and not replay(small, "", device=dev - 2 * MiB).ok


@pytest.mark.parametrize("trace, err, says", [
    (None, TypeError, "trace must be a list of .* got NoneType"),
    ([1, 2], ValueError, r"trace\[0\] must be a \(key, nbytes, ...\) tuple, got 1"),
    ([("a", 10), ("a",)], ValueError, r"trace\[1\] must be a \(key, nbytes, ...\) tuple"),
    ([("a", "10")], ValueError, r"trace\[0\] nbytes must be an int .* got '10'"),
    ([("a", 1.5)], ValueError, r"trace\[0\] nbytes must be an int .* got 1.5"),
])
def test_a_bad_trace_is_refused_naming_the_entry(trace, err, says):
    with pytest.raises(err, match=says):
        replay(trace)


# ---- the package --------------------------------------------------------------------------------
def test_each_module_is_under_500_lines_and_cites_no_file_a_user_lacks():
    modules = sorted(PACKAGE.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "config.py", "caching.py", "trace_replay.py", "textbook.py"}
    for path in modules:
        text = path.read_text()
        assert len(text.splitlines()) <= 500, f"{path.name}: {len(text.splitlines())} lines"
        assert "ALLOCATOR.md" not in text and "shared/" not in text, f"{path.name} cites a file users do not have"


def test_the_package_exports_every_name_of_its_all():
    for name in alloc.__all__:
        assert hasattr(alloc, name), name
    assert callable(lk.alloc.replay)
    assert alloc.K_SMALL_SIZE == MiB and alloc.Config().large_segment_size == 20 * MiB
    assert all(m.__name__.startswith("labkit.alloc.") for m in alloc.MODULES)


# ---- notebook 05's textbook allocators ------------------------------------------------------------
def test_first_fit_takes_the_first_hole_and_best_fit_the_smallest():
    trace = [("a", 4096), ("gap1", 8192), ("b", 512), ("gap2", 2048), ("c", 512),
             ("gap1", -8192), ("gap2", -2048), ("new", 1024)]
    ff, bf = FirstFit().replay(trace), BestFit().replay(trace)
    assert ff.live["new"][0] == 4096, "first fit: the first hole in address order (8 KiB at 4096)"
    assert bf.live["new"][0] == 4096 + 8192 + 512, "best fit: the smallest hole that fits (2 KiB)"
    assert ff.footprint == bf.footprint == 4096 + 8192 + 512 + 2048 + 512
    assert bf.looked >= ff.looked


def test_arena_merges_holes_and_shrinks_at_the_top():
    a = FirstFit().replay([("x", 1000), ("y", 1000), ("z", 1000), ("y", -1), ("x", -1)])
    assert a.holes == [(0, 2048)], "two neighbouring holes merge into one"
    a.free("z")
    assert a.holes == [] and a.top == 0 and a.held == 0 and a.footprint == 3 * 1024


def test_buddy_rounds_to_powers_of_two_and_merges_buddies():
    b = Buddy().replay([("a", 600), ("b", 3000)])
    assert b.live["a"] == (0, 10) and b.held == 1024 + 4096 and b.peak_held == 5120
    assert b.footprint == 4096 + 4096, "the 4 KiB block sits at the next 4 KiB boundary"
    b.free("a")
    b.free("b")
    assert b.free_at[b.order] == {0}, "everything merges back into the one whole block"


def test_textbook_replay_frees_a_live_key_before_reallocating_it():
    a = BestFit().replay([("k", 2048), ("k", 4096)])
    assert a.held == 4096 and list(a.live) == ["k"]


@pytest.mark.parametrize("cls", [FirstFit, BestFit, Buddy])
def test_footprint_is_at_least_the_live_peak(cls):
    trace = alloc.growing_batch(layers=4, batches=(1, 2, 3), per_sample=MiB)
    live = peak = 0
    for _, n, _ in trace:
        live += n
        peak = max(peak, live)
    a = cls().replay(trace)
    assert a.footprint >= a.peak_held >= peak


# ---- invariants, property-tested ------------------------------------------------------------------
CONFS = ["", "max_split_size_mb:24", "roundup_power2_divisions:4", "expandable_segments:True",
         "garbage_collection_threshold:0.5"]
sizes = st.one_of(st.integers(1, 4 * KiB), st.integers(1, 2 * MiB), st.integers(2 * MiB, 64 * MiB))
ops = st.lists(st.one_of(st.tuples(st.just("malloc"), sizes), st.tuples(st.just("free"), st.integers(0, 50)),
                         st.tuples(st.just("empty"), st.just(0))), max_size=60)


def _layout(a):
    return sorted((s["address"], s["total_size"], tuple((b["address"], b["size"], b["state"]) for b in s["blocks"]))
                  for s in a.snapshot()["segments"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFS), device_mib=st.sampled_from([None, 96, 200]), ops=ops)
def test_invariants_hold_and_a_failed_allocation_changes_only_the_cache(conf, device_mib, ops):
    device = None if device_mib is None else device_mib * MiB
    a = Allocator(conf, device=device, fraction=None if device is None else 1.0, history=False)
    live = []
    for op, arg in ops:
        if op == "malloc":
            before = copy.deepcopy(a)
            try:
                live.append(a.malloc(arg))
            except torch.OutOfMemoryError:
                before.empty_cache()                   # what the out-of-memory path may release, and nothing else
                assert _layout(a) == _layout(before)
                assert a.allocated == before.allocated and a.reserved == before.reserved
        elif op == "free" and live:
            a.free(live.pop(arg % len(live)))
        elif op == "empty":
            a.empty_cache()
        a.check()
        assert a.reserved >= a.allocated and (device is None or a.reserved <= device)
    for b in live:
        a.free(b)
    a.empty_cache()
    assert a.reserved == 0 and a.allocated == 0
