"""A model of PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`) that runs on a CPU.

It replays an allocation trace (what `lk.track()` records, or any list of `(key, +bytes)` allocations and
`(key, -bytes)` frees) through the same rules as the real allocator, one stream, one device:

- sizes rounded to 512 B, or to 1/d steps between powers of two with `roundup_power2_divisions`;
- a small pool (requests <= 1 MiB, carved from 2 MiB segments) and a large pool (requests < 10 MiB get a
  20 MiB segment, larger ones a segment rounded up to 2 MiB);
- best fit (the smallest cached block that holds the request, lowest address on ties), the split rules,
  `max_split_size_mb` (oversize blocks are never split and not handed to small requests);
- coalescing of free neighbours on free; nothing returns to the device on free;
- `empty_cache()`: only wholly free segments go back; `garbage_collection_threshold` under a memory
  fraction below 1.0 (`setMemoryFraction` sets no limit at 1.0, so no GC runs there);
  `expandable_segments` (one virtual range per pool, mapped in pages);
- the out-of-memory path: release oversize cached blocks, then every free segment, retry, else raise.

The rules were read from that source file (`DeviceCachingAllocator` and `AcceleratorAllocatorConfig` in PyTorch
2.13). What the model leaves out: streams and events (`record_stream`), CUDA graphs' private pools, the CUDA
context and other processes on the device, and the rare partial page mapping of expandable segments before an
out-of-memory error (the model maps all pages of a request or none).

One idea per module:
- `config`: `PYTORCH_CUDA_ALLOC_CONF` parsed, the constants, `round_size`, `allocation_size`;
- `caching`: `Allocator` (the model), `Block`, `Pool`;
- `trace_replay`: `replay`, `smallest_device`, and three synthetic traces where one setting matters each;
- `textbook`: first fit, best fit and buddy, the allocators a course starts from.

    a = Allocator("max_split_size_mb:128", device="40 GiB")
    r = replay(mem.trace, "expandable_segments:True")     # r.peak_reserved, r.reserved (over time)
    smallest_device(mem.trace, "")                        # bytes, by bisection
"""
from .caching import Allocator, Block, Pool
from .config import (IGNORED_KEYS, K_INTERVALS, K_MIN_BLOCK, K_MIN_LARGE_ALLOC, K_ROUND_LARGE, K_SMALL_BUFFER,
                     K_SMALL_SIZE, KNOWN_KEYS, SIZE_MAX, Config, allocation_size, parse_conf, round_size)
from .trace_replay import Replay, growing_batch, phases, pinned_holes, replay, smallest_device
from .textbook import TEXTBOOK, Arena, BestFit, Buddy, FirstFit, TextbookAllocator
from . import caching, config, textbook, trace_replay

__all__ = ["Config", "parse_conf", "round_size", "allocation_size", "Allocator", "Block", "Pool", "Replay",
           "K_INTERVALS", "K_MIN_BLOCK", "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE", "K_SMALL_BUFFER", "K_SMALL_SIZE", "SIZE_MAX",
           "replay", "smallest_device", "KNOWN_KEYS", "IGNORED_KEYS",
           "growing_batch", "pinned_holes", "phases",
           "TextbookAllocator", "Arena", "FirstFit", "BestFit", "Buddy", "TEXTBOOK", "MODULES"]

MODULES = (config, caching, trace_replay, textbook)   # everything the package defines, e.g. for lk.exercise(forbid=)
