"""The first design of vLLM's block allocator (`block_manager.py`, 2023): a free list and a reference count.

A KV cache is cut into `num_blocks` physical blocks of `block_size` tokens each. `allocate` pops a block
off the free list with one owner; `share` adds an owner (a forked sequence); `free` removes one and puts
the block back when none is left. Freeing a block nobody owns is a scheduler bug, so it fails loudly
(`Double free of block 7`), as does asking an empty pool for a block (`OutOfBlocks`).
"""
from ..checks import count, index

__all__ = ["BlockAllocator", "OutOfBlocks"]


class OutOfBlocks(RuntimeError):
    """Every physical block is in use."""


class BlockAllocator:
    """A free list of `num_blocks` physical blocks and a reference count for each."""

    def __init__(self, num_blocks, block_size=16):
        self.num_blocks = count("num_blocks", num_blocks)
        self.block_size = count("block_size", block_size)
        self.free_list = list(range(self.num_blocks - 1, -1, -1))   # pop() hands out 0, 1, 2, ...
        self.ref_count = [0] * self.num_blocks                      # owners of each block

    def allocate(self):
        """A free block, with reference count 1."""
        if not self.free_list:
            raise OutOfBlocks(f"out of KV blocks: all {self.num_blocks} blocks of {self.block_size} tokens are in use")
        block = self.free_list.pop()
        self.ref_count[block] = 1
        return block

    def share(self, block):
        """One more owner for `block` (it must be allocated: a free block has no contents to share)."""
        block = self.check(block, "share")
        self.ref_count[block] += 1

    def free(self, block):
        """One owner fewer; with none left the block returns to the free list."""
        block = self.check(block)
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_list.append(block)

    def check(self, block, action="free"):
        """`block` as an int, if it is a block of this pool that someone owns (`action` names the caller)."""
        block = index("block", block, self.num_blocks)
        if self.ref_count[block] == 0:
            if action == "free":
                raise ValueError(f"Double free of block {block}: it is not allocated")
            raise ValueError(f"cannot {action} block {block}: it is free (allocate it first)")
        return int(block)

    @property
    def num_free(self):
        """Blocks that `allocate` can hand out."""
        return len(self.free_list)
