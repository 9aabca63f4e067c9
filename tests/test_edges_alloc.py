"""labkit.alloc at its edges: the config rules PyTorch's parser enforces, GC only under a limit, bad traces."""
import pytest
import torch

from labkit.alloc import Allocator, parse_conf, phases, replay
from labkit.units import MiB


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


def test_gc_needs_a_fraction_below_one():
    trace = phases(500 * MiB)
    default = replay(trace, "", device=500 * MiB)
    at_one = replay(trace, "garbage_collection_threshold:0.5", device=500 * MiB, fraction=1.0)
    below = replay(trace, "garbage_collection_threshold:0.5", device=500 * MiB, fraction=0.999)
    assert at_one.allocator.gc_runs == 0
    assert (at_one.peak_reserved, at_one.retries) == (default.peak_reserved, default.retries)
    assert below.allocator.gc_runs >= 1 and below.peak_reserved < default.peak_reserved and below.retries == 0


def test_an_oom_trace_entry_records_the_rounded_size():
    a = Allocator(device=20 * MiB, history=True)
    with pytest.raises(torch.OutOfMemoryError):
        a.malloc(30 * MiB + 1)
    oom = [e for e in a.snapshot()["device_traces"][0] if e["action"] == "oom"]
    assert [e["size"] for e in oom] == [30 * MiB + 512]


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
