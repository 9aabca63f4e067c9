"""Every layer at once, as a server uses them: admission, swapping and (optionally) prefix caching.

`serving_tables(allocator, host=..., watermark=..., prefix_caching=...)` picks the class. The two places
where two layers meet are here: a full block of a sequence swapped back in whose hash still names a device
block (its own, freed but cached, or another sequence's) is shared, not copied back (vLLM v0's swap_in
allocates full blocks as cached ones); the blocks copied back are named again, so that later requests find
them.
"""
from .prefix import PrefixCachingTables
from .swapping import SwappingTables, copy_blocks

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

    def cached_on_device(self, seqs):
        """{host block: hash} of the swapped-out `seqs`' full blocks whose hash still names a device block."""
        return {block: h for seq in seqs for block, h in zip(self.swapped[seq][0], self.hashes[seq])
                if h in self.allocator.cached}

    def swap_in_cost(self, seqs, owners):
        """A block cached on the device is shared, not copied: it costs nothing if a sequence holds it, one
        block (it leaves the evictor) if none does."""
        cached = self.cached_on_device(seqs)
        free = {h for h in cached.values() if self.allocator.ref_count[self.allocator.cached[h]] == 0}
        return len(owners) - len(cached) + len(free)

    def device_blocks(self, seqs, owners):
        cached = self.cached_on_device(seqs)
        # looked up first: owned, they leave the evictor, where the copies' allocations below could take them
        to_device = {block: self.allocator.lookup(h) for block, h in cached.items()}
        for block, device_block in to_device.items():
            for _ in range(owners[block] - 1):
                self.allocator.share(device_block)
        copied = copy_blocks({block: n for block, n in owners.items() if block not in cached}, self.allocator)
        return {**to_device, **copied}, list(copied.items())


def serving_tables(allocator, *, host=None, watermark=0.0, prefix_caching=False):
    """Block tables with admission (`watermark`), swapping (a `host` pool) and, with `prefix_caching`, the
    prefix cache (then `allocator` must be a PrefixCachingAllocator)."""
    cls = PrefixServingTables if prefix_caching else ServingTables
    return cls(allocator, host=host, watermark=watermark)
