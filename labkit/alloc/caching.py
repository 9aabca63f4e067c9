"""The caching allocator itself, one device and one stream: pools of cached blocks, best fit, splitting and
merging, segments from the device, the out-of-memory path, garbage collection and expandable segments.

Read from PyTorch's `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`: `malloc`, `get_free_block`,
`should_split`, `alloc_found_block`, `try_merge_blocks`, `alloc_block`, `release_available_cached_blocks`,
`release_cached_blocks`, `garbage_collect_cached_blocks`, `ExpandableSegment`). Not modelled: streams and
events (`record_stream`), CUDA graphs' private pools, the CUDA context and other processes on the device, and
the rare partial page mapping of expandable segments before an out-of-memory error (the model maps all pages
of a request or none).
"""
from __future__ import annotations

import bisect

import torch

from ..checks import count
from ..units import MiB, fmt_bytes, parse_bytes
from .config import K_MIN_BLOCK, K_SMALL_BUFFER, K_SMALL_SIZE, SIZE_MAX, allocation_size, parse_conf, round_size

__all__ = ["Allocator", "Block", "Pool"]


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


class Pool:
    """One pool's cached free blocks (PyTorch's `BlockPool`): sorted by (size, address), so best fit is a bisection."""

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
        self.small, self.large = Pool(True), Pool(False)
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
        nbytes = count("nbytes", nbytes, 0)
        if nbytes == 0:
            return None                  # the real allocator returns a null pointer for 0 bytes
        size = round_size(nbytes, self.cfg)
        pool = self.small if size <= K_SMALL_SIZE else self.large
        alloc_size = allocation_size(size, self.cfg)
        block = self.find_free_block(pool, size)
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
    def find_free_block(self, pool, size):
        """Best fit (`get_free_block`): take the smallest cached block of `pool` that holds `size` bytes (the
        lowest address among equal sizes) out of the pool, or return None (the caller asks the device).

        With `max_split_size_mb` set, an oversize block (>= the limit) is not handed to a smaller request, and a
        request at or above the limit does not take a block `max_non_split_rounding` or more larger than itself."""
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
