"""Every layer at once, as a server uses them: admission, swapping and (optionally) prefix caching.

`serving_tables(allocator, host=..., watermark=..., prefix_caching=...)` picks the class. The one place
where two layers meet is here: a sequence swapped back in names its full blocks again, so that later
requests find them (unless another block took the name meanwhile).
"""
from .prefix import PrefixCachingTables
from .swapping import SwappingTables

__all__ = ["ServingTables", "PrefixServingTables", "serving_tables"]

ServingTables = SwappingTables          # admission + swapping: what a server without prefix caching runs


class PrefixServingTables(PrefixCachingTables, SwappingTables):
    """Admission, swapping and prefix caching over one PrefixCachingAllocator."""

    def swap_in(self, *seqs):
        copies = super().swap_in(*seqs)
        for seq in seqs:
            for block, block_hash in zip(self.tables[seq], self.hashes[seq]):
                self.allocator.cache(block, block_hash)
        return copies


def serving_tables(allocator, *, host=None, watermark=0.0, prefix_caching=False):
    """Block tables with admission (`watermark`), swapping (a `host` pool) and, with `prefix_caching`, the
    prefix cache (then `allocator` must be a PrefixCachingAllocator)."""
    cls = PrefixServingTables if prefix_caching else ServingTables
    return cls(allocator, host=host, watermark=watermark)
