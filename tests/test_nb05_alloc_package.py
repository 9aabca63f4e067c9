"""labkit.alloc as a package (issue 29): one idea per module, the old names still work, the taught code is
public; the textbook allocators of notebook 05 behave as their docstrings say."""
import pathlib

import pytest

import labkit as lk
from labkit import alloc
from labkit.alloc import Allocator, BestFit, Buddy, FirstFit
from labkit.units import MiB

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "labkit" / "alloc"


def test_each_module_is_under_500_lines_and_cites_no_file_a_user_lacks():
    modules = sorted(PACKAGE.glob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "config.py", "caching.py", "trace_replay.py", "textbook.py"}
    for path in modules:
        text = path.read_text()
        assert len(text.splitlines()) <= 500, f"{path.name}: {len(text.splitlines())} lines"
        assert "ALLOCATOR.md" not in text and "shared/" not in text, f"{path.name} cites a file users do not have"
    assert not (ROOT / "labkit" / "alloc.py").exists(), "the package replaces the module"


def test_the_package_exports_every_name_of_its_all():
    for name in alloc.__all__:
        assert hasattr(alloc, name), name
    assert lk.alloc.replay is alloc.trace_replay.replay and callable(lk.alloc.replay)
    assert alloc.K_SMALL_SIZE == MiB and alloc.Config().large_segment_size == 20 * MiB
    assert all(m.__name__.startswith("labkit.alloc.") for m in alloc.MODULES)


def test_find_free_block_is_best_fit_and_takes_the_block_out_of_the_pool():
    a = Allocator(history=False)
    for size, addr in ((30 * MiB, 3 << 30), (24 * MiB, 2 << 30), (24 * MiB, 1 << 30)):
        a.large.add(alloc.Block(addr, size, small=False))
    got = a.find_free_block(a.large, 22 * MiB)
    assert (got.size, got.ptr) == (24 * MiB, 1 << 30), "the smallest that fits, the lowest address on a tie"
    assert [b.ptr for _, _, b in a.large.blocks] == [2 << 30, 3 << 30]
    assert a.find_free_block(a.large, 40 * MiB) is None


def test_max_split_size_keeps_oversize_blocks_from_small_requests():
    a = Allocator("max_split_size_mb:128", history=False)
    a.large.add(alloc.Block(1 << 30, 200 * MiB, small=False))
    assert a.find_free_block(a.large, 30 * MiB) is None, "an oversize block is not handed to a smaller request"
    assert a.find_free_block(a.large, 190 * MiB).size == 200 * MiB, "within max_non_split_rounding (20 MiB)"


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
