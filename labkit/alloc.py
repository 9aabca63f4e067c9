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
  fraction below 1.0 (`set_memory_fraction` sets no limit at 1.0, so no GC runs there);
  `expandable_segments` (one virtual range per pool, mapped in pages);
- the out-of-memory path: release oversize cached blocks, then every free segment, retry, else raise.

The rules were read from the source (see ../shared/ALLOCATOR.md); what the model leaves out: streams
and events (`record_stream`), CUDA graphs' private pools, the CUDA context and other processes on the
device, and the rare partial page mapping of expandable segments before an out-of-memory error (the
model maps all pages of a request or none).

    a = Allocator("max_split_size_mb:64", device="40 GiB")
    r = replay(mem.trace, "expandable_segments:True")     # r.peak_reserved, r.reserved (over time)
    smallest_device(mem.trace, "")                        # bytes, by bisection
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch

from .units import MiB, fmt_bytes, parse_bytes

__all__ = ["Config", "parse_conf", "round_size", "allocation_size", "Allocator", "Block", "Replay",
           "replay", "smallest_device", "KNOWN_KEYS", "IGNORED_KEYS",
           "growing_batch", "pinned_holes", "phases"]

K_MIN_BLOCK = 512               # kMinBlockSize
K_SMALL_SIZE = MiB              # kSmallSize: the largest "small" request
K_SMALL_BUFFER = 2 * MiB        # kSmallBuffer: small-pool segments
K_MIN_LARGE_ALLOC = 10 * MiB    # kMinLargeAlloc: below this a large request gets a large_segment_size segment
K_ROUND_LARGE = 2 * MiB         # kRoundLarge
K_INTERVALS = 16                # kRoundUpPowerOfTwoIntervals, from 1 MiB up
SIZE_MAX = 2 ** 64 - 1          # "unlimited" max_split_size, as in the source

KNOWN_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
              "roundup_power2_divisions", "expandable_segments", "large_segment_size_mb",
              "per_process_memory_fraction")
# Keys PyTorch 2.13 accepts that do not change the device allocator's decisions (host/pinned memory,
# locking, graphs): accepted, no effect on the model.
IGNORED_KEYS = ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
                "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
                "throw_on_cudamalloc_oom", "backend")


@dataclass(frozen=True)
class Config:
    """The allocator settings, as parsed from a `PYTORCH_CUDA_ALLOC_CONF` string."""
    max_split_size: int = SIZE_MAX
    max_non_split_rounding: int = 20 * MiB
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple = (0,) * K_INTERVALS
    expandable_segments: bool = False
    large_segment_size: int = 20 * MiB
    per_process_memory_fraction: float | None = None
    text: str = ""


def _tokens(text):
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _int(value, key):
    if not isinstance(value, str):             # a bracketed list where one number belongs: key:[64]
        raise ValueError(f"{key} must be an integer, got [{''.join(value)}]")
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if v < 0:
        raise ValueError(f"{key} must not be negative, got {value!r}")
    return v


def _pow2(v):
    return v > 0 and v & (v - 1) == 0


def parse_conf(text=""):
    """Parse a `PYTORCH_CUDA_ALLOC_CONF` string ("key:value,key:[a:b,>:c]") into a `Config`.

    Unknown keys raise `ValueError` naming the key, as PyTorch does ("Unrecognized key").
    """
    if isinstance(text, Config):
        return text
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise TypeError(f"conf must be a PYTORCH_CUDA_ALLOC_CONF string, got {type(text).__name__}")
    tok = _tokens(text)
    kw, i = {}, 0
    # large_segment_size_mb first, wherever it stands: the two sizes below must be at least it, and
    # max_non_split_rounding defaults to it (AcceleratorAllocatorConfig::parseArgs reads it first too).
    segment_mb = 20
    for k in range(len(tok) - 2):
        if tok[k] == "large_segment_size_mb" and tok[k + 1] == ":":
            value = tok[k + 2]
            if value == "[":
                value = tok[k + 3:tok.index("]", k) if "]" in tok[k:] else len(tok)]
            segment_mb = _int(value, "large_segment_size_mb")
            if segment_mb <= K_MIN_LARGE_ALLOC // MiB:
                raise ValueError(f"large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // MiB} MB, got {segment_mb}")
    kw["max_non_split_rounding"] = kw["large_segment_size"] = segment_mb * MiB
    while i < len(tok):
        key = tok[i]
        if key == ",":
            i += 1
            continue
        if key not in KNOWN_KEYS and key not in IGNORED_KEYS:
            raise ValueError(f"Unrecognized key {key!r} in PYTORCH_CUDA_ALLOC_CONF {text!r}; "
                             f"the allocator knows {sorted(KNOWN_KEYS + IGNORED_KEYS)}")
        if i + 2 >= len(tok) or tok[i + 1] != ":":
            raise ValueError(f"{key} needs a value (key:value) in {text!r}")
        i += 2
        if tok[i] == "[":
            j = tok.index("]", i) if "]" in tok[i:] else None
            if j is None:
                raise ValueError(f"{key}: expected a closing ']' in {text!r}")
            value, i = tok[i + 1:j], j + 1
        else:
            value, i = tok[i], i + 1
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            v = _int(value, key)
            if v < segment_mb:
                raise ValueError(f"{key} too small, must be >= {segment_mb} (large_segment_size_mb), got {v}")
            kw["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = \
                min(v, SIZE_MAX // MiB) * MiB
        elif key == "large_segment_size_mb":
            pass                                      # read above
        elif key == "garbage_collection_threshold":
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"garbage_collection_threshold must be a number, got {value!r}") from None
            if not 0.0 < v < 1.0:
                raise ValueError(f"garbage_collection_threshold must be in (0.0, 1.0), got {v}")
            kw["garbage_collection_threshold"] = v
        elif key == "per_process_memory_fraction":
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"per_process_memory_fraction must be a number, got {value!r}") from None
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"per_process_memory_fraction must be in [0.0, 1.0], got {v}")
            kw["per_process_memory_fraction"] = v
        elif key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"expandable_segments must be True or False, got {value!r}")
            kw["expandable_segments"] = value == "True"
        elif key == "roundup_power2_divisions":
            kw["roundup_power2_divisions"] = _parse_divisions(value)
        elif key == "backend" and value != "native":
            raise ValueError(f"backend {value!r} is CUDA's own allocator (cudaMallocAsync), not the caching "
                             "allocator this module models; use backend:native")
    return Config(text=text, **kw)


def _parse_divisions(value):
    if isinstance(value, str):                      # one number for every interval
        d = _int(value, "roundup_power2_divisions")
        if not _pow2(d):         # PyTorch's single-number form: a power of 2 (0 only inside [...])
            raise ValueError(f"roundup_power2_divisions must be a power of 2 (0 only in the [size:divisions] "
                             f"form), got {d}")
        return (d,) * K_INTERVALS
    divs, first, last = [0] * K_INTERVALS, True, 0
    items = [t for t in value if t != ","]
    if len(items) % 3:
        raise ValueError(f"roundup_power2_divisions list must hold size:divisions pairs, got {''.join(value)!r}")
    for k in range(0, len(items), 3):
        size, colon, d = items[k:k + 3]
        d = _int(d, "roundup_power2_divisions")
        if colon != ":" or d and not _pow2(d):
            raise ValueError(f"roundup_power2_divisions divisions must be powers of 2 or 0, got {d}")
        if size == ">":
            divs[last + 1:] = [d] * (K_INTERVALS - last - 1)
            continue
        mb = _int(size, "roundup_power2_divisions interval")
        if not _pow2(mb):
            raise ValueError(f"roundup_power2_divisions intervals must be powers of 2 (MB), got {mb}")
        idx = min(mb.bit_length() - 1, K_INTERVALS - 1)
        if first:
            divs[:idx] = [d] * idx
            first = False
        divs[idx], last = d, idx
    return tuple(divs)


def round_size(size, cfg=Config()):
    """`round_size`: below 512 B -> 512 B; with d > 1 divisions and size > 512*d, up to the next 1/d step
    between powers of two; otherwise up to a multiple of 512."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    log = size.bit_length() - 1
    idx = min(max(log - 20, 0), K_INTERVALS - 1)
    d = cfg.roundup_power2_divisions[idx]
    if d > 1 and size > K_MIN_BLOCK * d:
        if size & (size - 1) == 0:
            return size
        floor = 1 << log
        step = floor >> (d.bit_length() - 1)
        if step == 0:
            return floor << 1
        down = size & ~(step - 1)
        return size if down == size else down + step
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(size, cfg=Config()):
    """`get_allocation_size`: the segment a new device malloc gets for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return cfg.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class Block:
    """A range of device memory: allocated, cached (free and mapped), or unmapped (expandable only)."""
    __slots__ = ("ptr", "size", "requested", "allocated", "mapped", "prev", "next", "small", "gc_base", "vseg")

    def __init__(self, ptr, size, small, prev=None, next=None, mapped=True, vseg=None):
        self.ptr, self.size, self.small = ptr, size, small
        self.requested, self.allocated, self.mapped = 0, False, mapped
        self.prev, self.next, self.gc_base, self.vseg = prev, next, 0, vseg

    def __repr__(self):
        state = "allocated" if self.allocated else "free" if self.mapped else "unmapped"
        return f"<Block {state} {fmt_bytes(self.size)} at {self.ptr:#x}>"


class _Pool:
    def __init__(self, small):
        self.small = small
        self.blocks = []          # sorted (size, ptr, block): the cached free blocks, best fit by bisect
        self.unmapped = []        # sorted (ptr, block): expandable segments' unmapped ranges
        self.calls = 0            # get_free_blocks_call_count (block ages for garbage collection)
        self.vseg = None          # the expandable segment's base address

    def add(self, b):
        b.gc_base = self.calls
        bisect.insort(self.blocks, (b.size, b.ptr, b))

    def remove(self, b):
        i = bisect.bisect_left(self.blocks, (b.size, b.ptr))
        assert self.blocks[i][2] is b, "pool out of order"
        del self.blocks[i]

    def add_unmapped(self, b):
        bisect.insort(self.unmapped, (b.ptr, b))

    def remove_unmapped(self, b):
        i = bisect.bisect_left(self.unmapped, (b.ptr,))
        assert self.unmapped[i][1] is b, "unmapped set out of order"
        del self.unmapped[i]


class Allocator:
    """The caching allocator, one device and one stream. `malloc(nbytes)` -> Block, `free(block)`.

    conf: a `PYTORCH_CUDA_ALLOC_CONF` string (or a `Config`).
    device: the device memory the allocator may obtain (bytes or "40 GiB"); None = unlimited.
    fraction: `torch.cuda.set_per_process_memory_fraction(fraction)`: allowed = fraction x device.
    history: keep a trace in the format of `torch.cuda.memory._snapshot()["device_traces"]`.
    """

    def __init__(self, conf="", device=None, fraction=None, history=True):
        self.cfg = parse_conf(conf)
        self.device = None if device is None else parse_bytes(device, "device")
        if fraction is None:
            fraction = self.cfg.per_process_memory_fraction
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
            if self.device is None:
                raise ValueError("fraction needs device= (the memory it is a fraction of), got device=None")
        self.fraction = fraction
        self.allowed = None if fraction is None else int(fraction * self.device)
        # set_memory_fraction sets no limit at 1.0 (`if (fraction < 1.0)` in DeviceCachingAllocator), and
        # garbage collection runs only under a limit: at 1.0 the threshold does nothing, as on a GPU.
        self.gc = fraction is not None and fraction < 1.0 and self.cfg.garbage_collection_threshold > 0
        self.small, self.large = _Pool(True), _Pool(False)
        self.segments = {}            # address -> (size, small) for device-malloc'ed segments
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.device_mallocs = self.device_frees = 0     # cudaMalloc/cudaFree, or pages mapped/unmapped
        self.retries = self.ooms = self.gc_runs = 0
        self.searches = 0             # best-fit look-ups (the search cost)
        self.history = [] if history else None
        self._next_addr = 1 << 40     # fake device addresses, segments far apart
        self._live_set = {}           # id -> allocated Block

    # ---- public -----------------------------------------------------------------------------
    def malloc(self, nbytes):
        """Allocate `nbytes`; returns the Block (None for 0 bytes) or raises torch.OutOfMemoryError."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        nbytes = int(nbytes)
        if nbytes == 0:
            return None                  # the real allocator returns a null pointer for 0 bytes
        size = round_size(nbytes, self.cfg)
        pool = self.small if size <= K_SMALL_SIZE else self.large
        alloc_size = allocation_size(size, self.cfg)
        block = self._get_free_block(pool, size)
        if block is None:
            if self.gc:
                self._garbage_collect()
            block = (self._alloc_block(pool, size, alloc_size)
                     or (self._release_available(pool, size) and self._alloc_block(pool, size, alloc_size))
                     or (self._release_cached() and self._retry(pool, size, alloc_size)))
            if not block:
                self.ooms += 1
                free = None if self.device is None else self.device - self.reserved
                self._trace("oom", 0, size, device_free=free)          # the rounded size, as PyTorch records
                raise torch.OutOfMemoryError(
                    f"model allocator: tried to allocate {fmt_bytes(nbytes)}; reserved {fmt_bytes(self.reserved)}, "
                    f"allocated {fmt_bytes(self.allocated)}, device {fmt_bytes(self.device)}"
                    + (f", allowed {fmt_bytes(self.allowed)}" if self.allowed is not None else ""))
        return self._alloc_found(block, pool, size, nbytes)

    def free(self, block):
        """Return a block to its pool and merge it with free neighbours (nothing goes to the device)."""
        if block is None:
            return
        if not isinstance(block, Block) or not block.allocated:
            raise ValueError(f"block must be an allocated Block from this allocator, got {block!r}")
        self._trace("free_requested", block.ptr, block.requested)
        block.allocated = False
        del self._live_set[id(block)]
        self.allocated -= block.size
        self._trace("free_completed", block.ptr, block.requested)
        pool = self.small if block.small else self.large
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.add(block)

    def empty_cache(self):
        """`release_cached_blocks`: every wholly free segment (or free page) goes back to the device."""
        for pool in (self.large, self.small):
            unmap = []
            for _, _, b in list(pool.blocks):
                if b.vseg is not None:
                    unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(b, pool)
            for b in unmap:
                self._unmap_block(b, pool)
        return True

    # ---- the search ---------------------------------------------------------------------------
    def _get_free_block(self, pool, size):
        if self.gc:
            pool.calls += 1
        self.searches += 1
        blocks = pool.blocks
        i = bisect.bisect_left(blocks, (size,))
        if i == len(blocks):
            return None
        b = blocks[i][2]
        if b.vseg is not None:       # best fit counts what a block can expand into
            def expandable(x):
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            while i + 1 < len(blocks) and blocks[i + 1][2].vseg is not None and \
                    expandable(blocks[i + 1][2]) < expandable(b):
                i += 1
                b = blocks[i][2]
        ms = self.cfg.max_split_size
        if size < ms and b.size >= ms:
            return None              # do not hand an oversize block to a small request
        if size >= ms and b.size >= size + self.cfg.max_non_split_rounding:
            return None              # nor a much larger one to a large request
        del blocks[i]
        return b

    def _should_split(self, block, size):
        remaining = block.size - size
        if block.small or self.cfg.expandable_segments:
            return remaining >= K_MIN_BLOCK
        return size < self.cfg.max_split_size and remaining > K_SMALL_SIZE

    def _alloc_found(self, block, pool, size, nbytes):
        if self._should_split(block, size):
            rest = Block(block.ptr + size, block.size - size, block.small, prev=block, next=block.next,
                         vseg=block.vseg)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated, block.requested = True, nbytes
        self._live_set[id(block)] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        self._trace("alloc", block.ptr, nbytes)
        return block

    def _merge(self, dst, src, pool):
        """`try_merge_blocks`: fold a free neighbour with the same mapped state into dst."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if src is dst.prev:
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ---- getting memory from the device ---------------------------------------------------------
    def _alloc_block(self, pool, size, alloc_size):
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self.cfg.expandable_segments:
            return self._try_expandable(pool, size)
        if self.device is not None and self.reserved + alloc_size > self.device:
            return None
        ptr = self._next_addr
        self._next_addr += -(-alloc_size // (64 * MiB)) * 64 * MiB + 64 * MiB
        self.segments[ptr] = (alloc_size, pool.small)
        self._grow(alloc_size)
        self._trace("segment_alloc", ptr, alloc_size)
        return Block(ptr, alloc_size, pool.small)

    def _retry(self, pool, size, alloc_size):
        self.retries += 1
        return self._alloc_block(pool, size, alloc_size)

    def _grow(self, n):
        self.reserved += n
        self.device_mallocs += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _release_block(self, b, pool):
        """cudaFree of a wholly free segment."""
        assert b.prev is None and b.next is None and not b.allocated and b.vseg is None
        pool.remove(b)
        del self.segments[b.ptr]
        self.reserved -= b.size
        self.device_frees += 1
        self._trace("segment_free", b.ptr, b.size)

    def _release_available(self, pool, size):
        """With max_split_size set: free oversize cached segments (largest first) and retry."""
        ms = self.cfg.max_split_size
        if ms == SIZE_MAX:
            return False
        key = max(size, ms)
        blocks = pool.blocks
        i = bisect.bisect_left(blocks, (key,))
        if i == len(blocks) or blocks[i][2].vseg is not None:
            released = 0
            i -= 1
            while i >= 0 and released < key and blocks[i][0] >= ms:
                b = blocks[i][2]
                i -= 1
                if b.vseg is None:
                    released += b.size
                    self._release_block(b, pool)
            return released >= key
        self._release_block(blocks[i][2], pool)
        return True

    def _release_cached(self):
        return self.empty_cache()

    def _garbage_collect(self):
        """`garbage_collect_cached_blocks`: past threshold x allowed, free old unsplit large segments."""
        threshold = int(self.cfg.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        self.gc_runs += 1
        target, reclaimed = self.reserved - threshold, 0
        pool = self.large
        whole = [b for _, _, b in pool.blocks if b.prev is None and b.next is None]
        total_age = sum(pool.calls - b.gc_base for b in whole)
        count = len(whole)
        freed = True
        while reclaimed < target and freed and count > 0:
            age = total_age / count
            freed = False
            for _, _, b in list(pool.blocks):
                if b.prev is None and b.next is None and b.vseg is None and pool.calls - b.gc_base >= age:
                    freed = True
                    reclaimed += b.size
                    total_age -= pool.calls - b.gc_base
                    count -= 1
                    self._release_block(b, pool)

    # ---- expandable segments ---------------------------------------------------------------------
    def _page(self, pool):
        return K_SMALL_BUFFER if pool.small else self.cfg.large_segment_size

    def _find_expandable(self, pool, size):
        def has_room(b):
            got = 0
            while got < size and b is not None and not b.allocated:
                got += b.size
                b = b.next
            return got >= size
        for _, c in pool.unmapped:
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if has_room(c):
                return c
        # A new virtual range: 1 1/8 of the device's memory (unlimited device: 64 TiB).
        span = (self.device + self.device // 8) if self.device is not None else 1 << 46
        page = self._page(pool)
        span = -(-span // page) * page
        base = self._next_addr
        self._next_addr += span + 64 * MiB
        c = Block(base, span, pool.small, mapped=False, vseg=base)
        pool.add_unmapped(c)
        return c

    def _try_expandable(self, pool, size):
        c = self._find_expandable(pool, size)
        page = self._page(pool)
        need, got, b = 0, 0, c         # pages to map: the model maps all of them or none
        while got < size and b is not None:
            if b.mapped:
                got += b.size
            else:
                m = min(b.size, -(-(size - got) // page) * page)
                need, got = need + m, got + m
            b = b.next
        if self.device is not None and self.reserved + need > self.device:
            return None
        if not c.mapped:
            c = self._map_block(c, min(c.size, -(-size // page) * page), pool)
        while c.size < size:
            nxt = c.next
            c = self._map_block(nxt, min(nxt.size, -(-(size - c.size) // page) * page), pool)
        pool.remove(c)
        return c

    def _map_block(self, b, size, pool):
        pool.remove_unmapped(b)
        b.mapped = True
        if size < b.size:
            rest = Block(b.ptr + size, b.size - size, b.small, prev=b, next=b.next, mapped=False, vseg=b.vseg)
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            pool.add_unmapped(rest)
        ptr = b.ptr
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.add(b)
        self._grow(size)
        self.device_mallocs += size // self._page(pool) - 1     # one map per page
        self._trace("segment_map", ptr, size)
        return b

    def _unmap_block(self, b, pool):
        page, base = self._page(pool), b.vseg
        begin = base + -(-(b.ptr - base) // page) * page
        end = base + (b.ptr + b.size - base) // page * page
        if begin >= end:
            return
        pool.remove(b)
        if begin > b.ptr:
            before = Block(b.ptr, begin - b.ptr, b.small, prev=b.prev, next=b, vseg=base)
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            pool.add(before)
        if end < b.ptr + b.size:
            after = Block(end, b.ptr + b.size - end, b.small, prev=b, next=b.next, vseg=base)
            if b.next is not None:
                b.next.prev = after
            b.next = after
            pool.add(after)
        b.ptr, b.size, b.mapped = begin, end - begin, False
        self._merge(b, b.prev, pool)
        self._merge(b, b.next, pool)
        pool.add_unmapped(b)
        self.reserved -= end - begin
        self.device_frees += (end - begin) // page
        self._trace("segment_unmap", begin, end - begin)

    # ---- reports ----------------------------------------------------------------------------------
    def _trace(self, action, addr, size, **extra):
        if self.history is not None:
            self.history.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": [],
                                 "time_us": len(self.history), **extra})

    def _all_blocks(self):
        """Every block of every segment, in address order, grouped by segment: [(seg_addr, size, small, exp, blocks)]."""
        out = []
        heads = {}
        for pool in (self.small, self.large):
            for _, _, b in pool.blocks:
                heads.setdefault(id(b), b)
            for _, b in pool.unmapped:
                heads.setdefault(id(b), b)
        # walk back to each chain's first block, then forward
        firsts = {}
        for b in list(heads.values()) + list(self._live_blocks()):
            while b.prev is not None:
                b = b.prev
            firsts[b.ptr] = b
        for ptr in sorted(firsts):
            chain, b = [], firsts[ptr]
            while b is not None:
                chain.append(b)
                b = b.next
            out.append(chain)
        return out

    def _live_blocks(self):
        return self._live_set.values()

    def check(self):
        """Assert the invariants: blocks tile their segments, no two free mapped neighbours stay unmerged,
        mapped bytes == reserved, allocated bytes == the allocated blocks, the pools hold exactly the free blocks."""
        mapped = allocated = 0
        free_seen = set()
        for chain in self._all_blocks():
            head = chain[0]
            if head.vseg is None:
                size, small = self.segments[head.ptr]
                assert sum(b.size for b in chain) == size, "blocks do not tile their segment"
            for a, b in zip(chain, chain[1:]):
                assert a.ptr + a.size == b.ptr and b.prev is a, "blocks not contiguous"
                assert a.allocated or b.allocated or a.mapped != b.mapped, "two free neighbours left unmerged"
            for b in chain:
                mapped += b.size if b.mapped else 0
                allocated += b.size if b.allocated else 0
                if b.mapped and not b.allocated:
                    free_seen.add(id(b))
        assert mapped == self.reserved, f"mapped {mapped} != reserved {self.reserved}"
        assert allocated == self.allocated, f"allocated blocks {allocated} != allocated {self.allocated}"
        pooled = {id(b) for p in (self.small, self.large) for _, _, b in p.blocks}
        assert pooled == free_seen, "the pools do not hold exactly the free blocks"
        return True

    def largest_free(self):
        """The largest cached free block (what one more request could get without a device malloc)."""
        return max((p.blocks[-1][0] for p in (self.small, self.large) if p.blocks), default=0)

    def snapshot(self):
        """The dict `torch.cuda.memory._snapshot()` returns: segments with blocks, and the device trace.

        Expandable segments are reported as one segment per mapped contiguous range, as PyTorch does.
        """
        segs = []
        for chain in self._all_blocks():
            runs, run = [], []
            for b in chain:
                if b.mapped:
                    run.append(b)
                elif run:
                    runs.append(run)
                    run = []
            if run:
                runs.append(run)
            for run in runs:
                blocks = [{"address": b.ptr, "size": b.size,
                           "requested_size": b.requested if b.allocated else b.size,
                           "state": "active_allocated" if b.allocated else "inactive", "frames": []}
                          for b in run]
                alloc = sum(b.size for b in run if b.allocated)
                segs.append({"device": 0, "address": run[0].ptr, "total_size": sum(b.size for b in run),
                             "stream": 0, "segment_type": "small" if run[0].small else "large",
                             "segment_pool_id": (0, 0), "allocated_size": alloc, "active_size": alloc,
                             "requested_size": sum(b.requested for b in run if b.allocated),
                             "is_expandable": run[0].vseg is not None, "frames": [], "blocks": blocks})
        return {"segments": segs, "device_traces": [list(self.history or [])],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": self.cfg.text}}


@dataclass
class Replay:
    """What replaying a trace did: bytes after every event, peaks, device calls, fragmentation at the peak."""
    conf: str
    allocated: np.ndarray            # after every event
    reserved: np.ndarray
    peak_allocated: int
    peak_reserved: int
    device_mallocs: int
    device_frees: int
    retries: int
    searches: int
    oom_at: int | None               # the event that failed (None: the trace ran)
    largest_free_at_peak: int        # the largest cached block at the reserved peak
    allocator: Allocator = field(repr=False)

    @property
    def ok(self):
        return self.oom_at is None

    @property
    def waste(self):
        """Peak reserved beyond the peak of allocated blocks, as a fraction of the latter."""
        return self.peak_reserved / self.peak_allocated - 1 if self.peak_allocated else 0.0

    @property
    def free_at_peak(self):
        """Cached (reserved, unallocated) bytes at the reserved peak."""
        i = int(np.argmax(self.reserved)) if len(self.reserved) else 0
        return int(self.reserved[i] - self.allocated[i]) if len(self.reserved) else 0

    def snapshot(self):
        return self.allocator.snapshot()


def _events(trace):
    """(key, +bytes) / (key, -bytes) pairs from a list of tuples or a `track()` report."""
    if hasattr(trace, "trace") and not isinstance(trace, (list, tuple)):
        trace = trace.trace
    if not isinstance(trace, (list, tuple)):
        raise TypeError(f"trace must be a list of (key, nbytes, ...) tuples or a track() report, "
                        f"got {type(trace).__name__}")
    for i, ev in enumerate(trace):
        if not isinstance(ev, (list, tuple)) or len(ev) < 2:
            raise ValueError(f"trace[{i}] must be a (key, nbytes, ...) tuple, got {ev!r}")
        n = ev[1]
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise ValueError(f"trace[{i}] nbytes must be an int (> 0 allocates, < 0 frees), got {n!r}")
    return trace


def replay(trace, conf="", device=None, fraction=None, history=False, stop_on_oom=True):
    """Replay an allocation trace through the model; returns a `Replay`.

    trace: [(key, nbytes, ...)]: nbytes > 0 allocates for `key` (a live key is resized: a new block, then
    the old one freed, as a storage resize does on CUDA), nbytes < 0 frees it; or a `track()` report.
    An out-of-memory error stops the replay (`oom_at` says where) unless stop_on_oom=False.
    """
    a = Allocator(conf, device=device, fraction=fraction, history=history)
    live = {}
    events = _events(trace)
    n = len(events)
    alloc_t = np.zeros(n, dtype=np.int64)
    res_t = np.zeros(n, dtype=np.int64)
    oom_at, peak, largest = None, -1, 0
    malloc, free = a.malloc, a.free
    for i, ev in enumerate(events):
        key, nbytes = ev[0], ev[1]
        if nbytes > 0:
            try:
                b = malloc(nbytes)
            except torch.OutOfMemoryError:
                if oom_at is None:
                    oom_at = i
                alloc_t[i:], res_t[i:] = a.allocated, a.reserved
                if stop_on_oom:
                    alloc_t, res_t = alloc_t[:i + 1], res_t[:i + 1]
                    break
                continue
            old = live.get(key)
            live[key] = b
            if old is not None:
                free(old)
        elif nbytes < 0:
            b = live.pop(key, None)
            if b is not None:
                free(b)
        alloc_t[i], res_t[i] = a.allocated, a.reserved
        if a.reserved > peak:
            peak, largest = a.reserved, a.largest_free()
    return Replay(a.cfg.text, alloc_t, res_t, a.peak_allocated, a.peak_reserved, a.device_mallocs,
                  a.device_frees, a.retries, a.searches, oom_at, largest, a)


def smallest_device(trace, conf="", fraction=None, step=2 * MiB):
    """The smallest device (bytes, a multiple of `step`) on which the trace runs, by bisection.

    Below the peak of allocated blocks nothing runs; with unlimited memory it runs at its peak reserved.
    Bisection assumes a larger device never fails where a smaller one runs (true of these rules in
    practice; the answer is re-checked to run).
    """
    events = _events(trace)
    free_run = replay(events, conf)
    lo = free_run.peak_allocated // step            # fails (or is the floor)
    hi = -(-free_run.peak_reserved // step)         # runs
    if replay(events, conf, device=lo * step, fraction=fraction).ok:
        return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if replay(events, conf, device=mid * step, fraction=fraction).ok:
            hi = mid
        else:
            lo = mid
    return hi * step


# ---- synthetic traces where each knob matters -------------------------------------------------------
def growing_batch(layers=24, batches=(8, 10, 12, 14, 16), per_sample=15 * MiB // 16):
    """Each step allocates one activation per layer (batch x per_sample bytes), then frees them all; the
    batch grows step by step (the case in the allocator's own note on expandable segments)."""
    trace, key = [], 0
    for b in batches:
        keys = range(key, key + layers)
        key += layers
        trace += [(k, b * per_sample, "activations") for k in keys]
        trace += [(k, -b * per_sample, "activations") for k in reversed(keys)]
    return trace


def pinned_holes(rounds=40, temp_start=20 * MiB, temp_step=MiB, small=2 * MiB):
    """Large temporaries of growing size, each followed by a small long-lived tensor (1-10 MiB: large pool)
    that stays: the small ones pin whatever page they land on."""
    trace = []
    for i in range(rounds):
        t = temp_start + i * temp_step
        trace += [(("t", i), t, "activations"), (("s", i), small, "other"), (("t", i), -t, "activations")]
    return trace


def phases(device=500 * MiB, first=12 * MiB, second=30 * MiB, reps=3):
    """Phases of differently sized tensors: three rounds filling most of the device with `first`-sized
    tensors, then three with `second`-sized ones. The first phase's cached segments do not fit the second."""
    trace, key = [], 0
    for size in (first, second):
        n = int(device * 0.85) // size
        for _ in range(reps):
            keys = range(key, key + n)
            key += n
            trace += [(k, size, "activations") for k in keys] + [(k, -size, "activations") for k in keys]
    return trace
