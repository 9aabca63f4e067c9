"""Admission control on top of block tables: may a new sequence start NOW, LATER, or NEVER?

After vLLM's `can_allocate` (v0.2 on): a *watermark* of free blocks is kept for the running sequences'
next tokens, so that admitting one more request does not force a preemption at the next decode step.
"""
import numbers

from .tables import BlockTables, blocks_for

__all__ = ["NOW", "LATER", "NEVER", "admission_status", "WatermarkTables"]

NOW, LATER, NEVER = "now", "later", "never"            # after vLLM's AllocStatus


def admission_status(free_blocks, total_blocks, need, watermark_blocks, all_blocks=None):
    """NOW, LATER or NEVER for a request that takes `need` blocks from the pool, keeping `watermark_blocks`
    free. NEVER: `all_blocks` (its whole size, `need` unless some are shared) would not fit an empty pool
    with the watermark kept free. NOW: it fits now with the watermark left. LATER: wait for frees."""
    if total_blocks - (need if all_blocks is None else all_blocks) < watermark_blocks:
        return NEVER
    return NOW if free_blocks - need >= watermark_blocks else LATER


class WatermarkTables(BlockTables):
    """Block tables that answer `can_allocate(tokens)` with NOW, LATER or NEVER, keeping a watermark free."""

    def __init__(self, allocator, *, watermark=0.0, **options):
        super().__init__(allocator, **options)
        if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {watermark!r}")
        self.watermark_blocks = int(watermark * allocator.num_blocks)   # kept free for running sequences

    def can_allocate(self, tokens):
        """NOW, LATER or NEVER for a new sequence of `tokens` (a count or token ids). Blocks it would share
        with running sequences (prefix caching) cost nothing now, but count toward NEVER."""
        whole = blocks_for(self.count_tokens(tokens)[0], self.allocator.block_size)
        return admission_status(self.allocator.num_free, self.allocator.num_blocks, self.new_blocks(tokens),
                                self.watermark_blocks, all_blocks=whole)
