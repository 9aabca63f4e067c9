"""PagedAttention's memory manager, after the first design of vLLM's `block_manager.py` (2023).

The KV cache is cut into fixed-size *blocks* of `block_size` tokens. A sequence owns a *block table*,
the list of physical blocks that hold its tokens in order, so its cache need not be contiguous and
grows one block at a time. Blocks are reference counted: `fork` lets a child share its parent's
blocks (parallel sampling, beam search) and `append` copies a shared block before writing into it
(copy-on-write). Errors are loud: a double free or an exhausted pool raises at once.
"""
from __future__ import annotations

__all__ = ["BlockAllocator", "BlockTables", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """Every physical block is in use."""


class BlockAllocator:
    """A free list of `num_blocks` physical blocks and a reference count for each."""

    def __init__(self, num_blocks, block_size=16):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_list = list(range(num_blocks - 1, -1, -1))     # pop() hands out 0, 1, 2, ...
        self.ref_count = [0] * num_blocks

    def allocate(self):
        """A free block, with reference count 1."""
        if not self.free_list:
            raise OutOfBlocks(f"out of KV blocks: all {self.num_blocks} blocks of {self.block_size} tokens are in use")
        block = self.free_list.pop()
        self.ref_count[block] = 1
        return block

    def share(self, block):
        """One more owner for `block`."""
        self._check(block)
        self.ref_count[block] += 1

    def free(self, block):
        """One owner fewer; the block returns to the free list when none is left."""
        self._check(block)
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_list.append(block)

    def _check(self, block):
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")
        if self.ref_count[block] == 0:
            raise ValueError(f"Double free of block {block}: it is not allocated")

    @property
    def num_free(self):
        return len(self.free_list)


class BlockTables:
    """Per-sequence block tables over one allocator: add, append, fork (copy-on-write), free."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.tables, self.lengths = {}, {}
        self.copies = []                   # (src, dst) block copies that copy-on-write asked for

    def add(self, seq, tokens=0):
        """A new sequence holding `tokens` tokens (its prompt)."""
        if seq in self.tables:
            raise ValueError(f"seq {seq!r} already exists")
        self.tables[seq], self.lengths[seq] = [], 0
        try:
            self.append(seq, tokens)
        except OutOfBlocks:                # all or nothing: no empty table left behind
            del self.tables[seq], self.lengths[seq]
            raise

    def append(self, seq, tokens=1):
        """Room for `tokens` more tokens of `seq`: a new block when the last is full, a private copy
        of the last block when it is shared (copy-on-write). All or nothing on OutOfBlocks."""
        table, bs = self._table(seq), self.allocator.block_size
        length = self.lengths[seq]
        need = -(-(length + tokens) // bs) - len(table)
        cow = length % bs != 0 and tokens > 0 and self.allocator.ref_count[table[-1]] > 1
        if need + cow > self.allocator.num_free:
            raise OutOfBlocks(f"seq {seq!r} needs {need + cow} blocks, {self.allocator.num_free} are free")
        if cow:
            fresh = self.allocator.allocate()
            self.copies.append((table[-1], fresh))
            self.allocator.free(table[-1])
            table[-1] = fresh
        table.extend(self.allocator.allocate() for _ in range(need))
        self.lengths[seq] = length + tokens

    def fork(self, parent, child):
        """`child` starts as `parent`, sharing every block (no copy until one of them writes)."""
        if child in self.tables:
            raise ValueError(f"seq {child!r} already exists")
        for block in self._table(parent):
            self.allocator.share(block)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]

    def free(self, seq):
        """Release every block of `seq`."""
        for block in self._table(seq):
            self.allocator.free(block)
        del self.tables[seq], self.lengths[seq]

    def slots(self, seq):
        """Physical slot (block * block_size + offset) of each of `seq`'s tokens, in order."""
        bs, table = self.allocator.block_size, self._table(seq)
        return [table[t // bs] * bs + t % bs for t in range(self.lengths[seq])]

    def _table(self, seq):
        if seq not in self.tables:
            raise KeyError(f"seq {seq!r} is unknown; known: {sorted(map(str, self.tables))[:10]}")
        return self.tables[seq]

    @property
    def blocks_in_use(self):
        return self.allocator.num_blocks - self.allocator.num_free

    @property
    def tokens(self):
        return sum(self.lengths.values())
