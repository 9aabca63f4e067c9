"""The three textbook allocators of notebook 05 (first fit, best fit, buddy), small enough to read, each over one
address range that grows at the top as needed.

Their *footprint* is the highest address ever used: what a device would have to hold. `peak_held` is the peak of
the live blocks' bytes as rounded (beyond the requests: internal fragmentation, rounding inside blocks); the
footprint beyond it is external fragmentation (holes between blocks). `looked` counts the holes (or, for buddy,
the block orders) each looks at, the search cost. They know nothing of PyTorch's pools and
segments: `labkit.alloc.Allocator` is the model of those.

    a = BestFit().replay(mem.trace)        # a.footprint, a.looked
"""
from __future__ import annotations

import bisect

__all__ = ["TextbookAllocator", "Arena", "FirstFit", "BestFit", "Buddy", "TEXTBOOK"]

ALIGN = 512                      # every request rounded up to 512 bytes, as PyTorch's kMinBlockSize


class TextbookAllocator:
    """What the three share: `malloc(key, nbytes)`, `free(key)`, and `replay(trace)` over a list of
    (key, +bytes, ...) allocations and (key, -bytes, ...) frees (a live key allocated again is freed first)."""

    def __init__(self):
        self.live = {}           # key -> (address, size or order)
        self.footprint = 0       # the highest address ever used
        self.looked = 0          # holes (or block orders) looked at, over all allocations
        self.held = self.peak_held = 0   # bytes of live blocks, as rounded: beyond the requests is rounding waste

    def replay(self, trace):
        for event in trace:
            key, nbytes = event[0], event[1]
            if key in self.live:
                self.free(key)
            if nbytes > 0:
                self.malloc(key, nbytes)
        return self


class Arena(TextbookAllocator):
    """One growing address range and a sorted list of (address, size) holes; `pick(n)` chooses a hole."""

    def __init__(self):
        super().__init__()
        self.holes = []          # sorted by address: [(address, size)]
        self.top = 0             # the end of the range in use

    def pick(self, n):
        """The index of the hole to carve `n` bytes from, or None (grow at the top)."""
        raise NotImplementedError("a subclass (FirstFit, BestFit) says which hole to take")

    def malloc(self, key, n):
        n = -(-n // ALIGN) * ALIGN
        i = self.pick(n)
        if i is None:                                   # no hole fits: grow at the top
            addr, self.top = self.top, self.top + n
            self.footprint = max(self.footprint, self.top)
        else:
            addr, size = self.holes[i]
            if size == n:
                del self.holes[i]
            else:
                self.holes[i] = (addr + n, size - n)    # the rest of the hole stays a hole
        self.live[key] = (addr, n)
        self.held += n
        self.peak_held = max(self.peak_held, self.held)

    def free(self, key):
        addr, n = self.live.pop(key)
        self.held -= n
        i = bisect.bisect(self.holes, (addr,))
        if i < len(self.holes) and addr + n == self.holes[i][0]:            # merge with the next hole
            n += self.holes.pop(i)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == addr:  # and with the previous one
            i -= 1
            addr, prev = self.holes.pop(i)
            n += prev
        if addr + n == self.top:
            self.top = addr                             # a hole at the top shrinks the range
        else:
            self.holes.insert(i, (addr, n))


class FirstFit(Arena):
    """Takes the first hole, in address order, that is large enough."""

    def pick(self, n):
        for i, (_, size) in enumerate(self.holes):
            self.looked += 1
            if size >= n:
                return i
        return None


class BestFit(Arena):
    """Takes the smallest hole that is large enough: it must look at every hole."""

    def pick(self, n):
        self.looked += len(self.holes)
        fits = [(size, i) for i, (_, size) in enumerate(self.holes) if size >= n]
        return min(fits)[1] if fits else None


class Buddy(TextbookAllocator):
    """Binary buddy allocator: blocks of 2**k bytes (k >= 9), larger blocks split in halves, a freed block
    merged with its buddy (the other half) while that is free too."""

    def __init__(self, order=44):
        super().__init__()
        self.order = order                  # the whole range: 2**order bytes (16 TiB)
        self.free_at = {order: {0}}         # k -> addresses of the free blocks of 2**k bytes

    def malloc(self, key, n):
        k = max(9, (n - 1).bit_length())    # the smallest power of two that holds n bytes
        j = k
        while not self.free_at.get(j):
            self.looked += 1
            j += 1
        addr = min(self.free_at[j])
        self.free_at[j].discard(addr)
        while j > k:                        # split: keep the lower half, free the upper
            j -= 1
            self.free_at.setdefault(j, set()).add(addr + (1 << j))
        self.live[key] = (addr, k)
        self.footprint = max(self.footprint, addr + (1 << k))
        self.held += 1 << k
        self.peak_held = max(self.peak_held, self.held)

    def free(self, key):
        addr, k = self.live.pop(key)
        self.held -= 1 << k
        while k < self.order and addr ^ (1 << k) in self.free_at.get(k, ()):
            self.free_at[k].discard(addr ^ (1 << k))    # merge with the buddy
            addr &= ~(1 << k)
            k += 1
        self.free_at.setdefault(k, set()).add(addr)


TEXTBOOK = {"first fit": FirstFit, "best fit": BestFit, "buddy": Buddy}
