"""PagedAttention's memory manager, after the first design of vLLM's `block_manager.py` (Kwon et al. 2023),
with the later layers on top, one module each (read them in this order; each needs only those above it):

- `allocator`: `BlockAllocator`, a free list and a reference count per block; `OutOfBlocks`.
- `tables`: `BlockTables`, each sequence's block table: add, append, fork (copy-on-write), free, slots.
- `admission`: `WatermarkTables.can_allocate` answers NOW, LATER or NEVER, keeping a watermark free.
- `swapping`: `SwappingTables.swap_out` / `swap_in` move sequences to a host pool and back.
- `prefix`: `block_hashes`, `PrefixCachingAllocator` (named blocks, an LRU evictor) and `PrefixCachingTables`.
- `serving`: `serving_tables(...)`, all of them together, as notebook 07's scheduler uses them.

The layout a kernel reads (labkit.flash.paged_attention, notebooks 07 and 08): `tables.tables[seq]` is the
list of physical block ids of a sequence, `tables.lengths[seq]` its number of tokens; token t of `seq` lives
at slot `tables.tables[seq][t // block_size] * block_size + t % block_size` (`tables.slots(seq)`), i.e. at
`[block, t % block_size]` of a `(num_blocks, block_size, ...)` view of the pool.

Errors are loud: a double free, an exhausted pool, or freeing a sequence that is not there (never added,
or freed already: a scheduler bug; vLLM silently ignores it) raise at once.
"""
from . import admission, allocator, prefix, serving, swapping, tables
from .admission import LATER, NEVER, NOW, WatermarkTables, admission_status
from .allocator import BlockAllocator, OutOfBlocks
from .prefix import PrefixCachingAllocator, PrefixCachingTables, block_hashes
from .serving import PrefixServingTables, ServingTables, serving_tables
from .swapping import SwappingTables, copy_blocks
from .tables import BlockTables

__all__ = ["BlockAllocator", "OutOfBlocks", "BlockTables", "WatermarkTables", "admission_status", "SwappingTables",
           "copy_blocks", "block_hashes", "PrefixCachingAllocator", "PrefixCachingTables", "ServingTables",
           "PrefixServingTables", "serving_tables", "NOW", "LATER", "NEVER"]
