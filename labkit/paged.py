"""PagedAttention's memory manager, after the first design of vLLM's `block_manager.py` (2023).

The KV cache is cut into fixed-size *blocks* of `block_size` tokens. A sequence owns a *block table*,
the list of physical blocks that hold its tokens in order, so its cache need not be contiguous and
grows one block at a time. Blocks are reference counted: `fork` lets a child share its parent's
blocks (parallel sampling, beam search) and `append` copies a shared block before writing into it
(copy-on-write). Errors are loud: a double free or an exhausted pool raises at once.

The layout a kernel reads (labkit.flash.paged_attention, notebooks 07 and 08): `tables.tables[seq]` is
the list of physical block ids of a sequence on the device, `tables.lengths[seq]` its number of tokens,
`tables.allocator.block_size` the tokens per block. Token t of `seq` lives at slot
`tables.tables[seq][t // block_size] * block_size + t % block_size` of a pool of
`allocator.num_blocks * block_size` slots (`tables.slots(seq)`), i.e. at `[block, t % block_size]` of a
`(num_blocks, block_size, ...)` view of the same pool. A sequence swapped out to the host is not in
`tables` (nor in `lengths`) until it is swapped back in.

Beyond the first design (vLLM's later block managers, v0.4 to v1):
- Admission control: `can_allocate(tokens)` answers NOW, LATER or NEVER, keeping a *watermark* of free
  blocks for the running sequences to grow into (`BlockTables(..., watermark=0.01)`).
- Preemption by swapping: `swap_out(*seqs)` moves sequences' blocks to a host pool
  (`BlockTables(..., host=BlockAllocator(...))`) and `swap_in(*seqs)` brings them back; each returns the
  (source, destination) block copies for the engine to perform. (The other way, recomputation, needs no
  support here: free the sequence, later `add` its prompt and generated tokens again in one prefill.)
- Prefix caching (`BlockTables(..., prefix_caching=True)`, token ids instead of counts): a full block is
  named by `block_hashes`, a hash of its tokens and of the blocks before it; a new sequence whose leading
  blocks are cached shares them through the reference counts. A cached block whose last owner leaves is
  kept, free but cached, in the allocator's LRU `evictor` until a fresh block is needed.
- Copy-on-write copies wait in `tables.copies` until the engine takes them, once per step, with
  `take_copies()`.
- Freeing a sequence that is not there (never added, or freed already) raises KeyError, like a double
  free of a block: it is a scheduler bug. (vLLM silently ignores it.)
"""
from __future__ import annotations

import collections
import numbers
import operator

__all__ = ["BlockAllocator", "BlockTables", "OutOfBlocks", "block_hashes", "NOW", "LATER", "NEVER"]

NOW, LATER, NEVER = "now", "later", "never"            # can_allocate's answers, after vLLM's AllocStatus


class OutOfBlocks(RuntimeError):
    """Every physical block is in use."""


def block_hashes(token_ids, block_size, parent=None):
    """The hash of each full block of `token_ids`: `hash((previous block's hash, block's tokens))`.

    The first block's previous hash is `parent` (None). Chaining makes a hash name a block's tokens AND
    everything before them: the same tokens after another prefix have other keys and values.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    ids = _ids(token_ids, "token_ids")
    hashes = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


def _ids(tokens, name):
    """Token ids as a list of ints: whole numbers only (1.7 is not a token id), one flat sequence."""
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise TypeError(f"{name} must be a sequence of token ids, got {tokens!r}")
    ids = []
    for i, t in enumerate(tokens):
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise TypeError(f"{name}[{i}] must be an int token id, got {t!r}") from None
    return ids


class BlockAllocator:
    """A free list of `num_blocks` physical blocks and a reference count for each.

    For prefix caching it also maps hashes to the full blocks that hold them (`cached`, `hash_of`);
    a cached block whose count falls to 0 waits in `evictor` (least recently freed first) instead of
    the free list, and is handed out again only when the free list is empty.
    """

    def __init__(self, num_blocks, block_size=16):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_list = list(range(num_blocks - 1, -1, -1))     # pop() hands out 0, 1, 2, ...
        self.ref_count = [0] * num_blocks
        self.cached, self.hash_of = {}, {}                       # hash -> block, block -> hash
        self.evictor = collections.OrderedDict()                 # free but cached blocks, LRU first
        self.evictions = 0

    def allocate(self):
        """A free block, with reference count 1: from the free list, else the least recently used cached one."""
        if self.free_list:
            block = self.free_list.pop()
        elif self.evictor:
            block, _ = self.evictor.popitem(last=False)          # its contents are overwritten: forget its hash
            del self.cached[self.hash_of.pop(block)]
            self.evictions += 1
        else:
            raise OutOfBlocks(f"out of KV blocks: all {self.num_blocks} blocks of {self.block_size} tokens are in use")
        self.ref_count[block] = 1
        return block

    def share(self, block):
        """One more owner for `block` (it must be allocated: a free block has no contents to share)."""
        self._check(block, "share")
        self.ref_count[block] += 1

    def free(self, block):
        """One owner fewer; at none the block returns to the free list (to the evictor if it is cached)."""
        self._check(block)
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self.hash_of:
                self.evictor[block] = None
            else:
                self.free_list.append(block)

    def cache(self, block, block_hash):
        """Names the full, allocated `block` by its hash so that later sequences can share it.
        False (and nothing changes) when the hash already names another block or the block has a name."""
        self._check(block, "cache")
        if block_hash in self.cached or block in self.hash_of:
            return False
        self.cached[block_hash], self.hash_of[block] = block, block_hash
        return True

    def lookup(self, block_hash):
        """The block cached under `block_hash` with one more owner (out of the evictor if it was free), or None."""
        block = self.cached.get(block_hash)
        if block is not None:
            if self.ref_count[block] == 0:
                del self.evictor[block]
            self.ref_count[block] += 1
        return block

    def _check(self, block, action="free"):
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be an int in [0, {self.num_blocks}), got {block!r}")
        if self.ref_count[block] == 0:
            if action == "free":
                raise ValueError(f"Double free of block {block}: it is not allocated")
            raise ValueError(f"cannot {action} block {block}: it is free (allocate it first)")

    @property
    def num_free(self):
        """Blocks that `allocate` can hand out: the free list and the free-but-cached ones."""
        return len(self.free_list) + len(self.evictor)


class BlockTables:
    """Per-sequence block tables over one allocator: add, append, fork (copy-on-write), free;
    admission (`can_allocate`), swapping to a host pool, prefix caching."""

    def __init__(self, allocator, *, host=None, watermark=0.0, prefix_caching=False):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        if host is not None and (not isinstance(host, BlockAllocator) or host.block_size != allocator.block_size):
            raise ValueError(f"host must be a BlockAllocator with block_size {allocator.block_size}, got {host!r}")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction of the blocks in [0, 1), got {watermark!r}")
        self.allocator, self.host, self.prefix_caching = allocator, host, bool(prefix_caching)
        self.watermark_blocks = int(watermark * allocator.num_blocks)   # kept free for running sequences
        self.tables, self.lengths = {}, {}
        self.token_ids, self.hashes = {}, {}       # prefix caching: each sequence's tokens and full blocks' hashes
        self.swapped = {}                          # seq -> (host block table, length) while swapped out
        self.copies = []                           # (src, dst) copies that copy-on-write asked for, not yet taken
        self.prefix_queries = self.prefix_hits = 0     # full prompt blocks looked up / found in the cache

    # -- admission ------------------------------------------------------------------------------------
    def can_allocate(self, tokens):
        """NOW, LATER or NEVER for a new sequence of `tokens` (a count, or token ids under prefix caching).

        NEVER: it would not fit even into an empty pool with the watermark kept free. NOW: it fits and
        `watermark_blocks` stay free for the running sequences' next tokens. LATER: wait for frees.
        Cached blocks in use by other sequences cost nothing (after vLLM's `can_allocate`).
        """
        count, ids = self._tokens(tokens, "tokens")
        need = -(-count // self.allocator.block_size)
        if self.allocator.num_blocks - need < self.watermark_blocks:
            return NEVER
        need -= self._cached_prefix(ids)[1]
        return NOW if self.allocator.num_free - need >= self.watermark_blocks else LATER

    def _cached_prefix(self, ids):
        """(leading full blocks of `ids` in the prefix cache, how many of those other sequences hold)."""
        found = in_use = 0
        for h in (block_hashes(ids, self.allocator.block_size) if self.prefix_caching else []):
            block = self.allocator.cached.get(h)
            if block is None:
                break
            found, in_use = found + 1, in_use + (self.allocator.ref_count[block] > 0)
        return found, in_use

    def add(self, seq, tokens=0):
        """A new sequence holding `tokens` (its prompt): a count, or token ids (required under prefix
        caching). Returns how many of its tokens were found in the prefix cache. All or nothing."""
        if seq in self.tables or seq in self.swapped:
            raise ValueError(f"seq {seq!r} already exists")
        count, ids = self._tokens(tokens, "tokens")
        need = -(-count // self.allocator.block_size) - self._cached_prefix(ids)[1]   # a free cached hit costs a block
        if need > self.allocator.num_free:         # all or nothing: checked before anything changes
            raise OutOfBlocks(f"seq {seq!r} needs {need} blocks, {self.allocator.num_free} are free")
        self.tables[seq], self.lengths[seq] = [], 0
        if not self.prefix_caching:
            self.append(seq, count)
            return 0
        self.token_ids[seq], self.hashes[seq] = [], []
        hits = self._reuse_cached_prefix(seq, ids)
        self.append(seq, ids[hits * self.allocator.block_size:])
        return hits * self.allocator.block_size

    def _reuse_cached_prefix(self, seq, ids):
        """Shares the longest run of leading full blocks already cached; the number of blocks reused."""
        hashes = block_hashes(ids, self.allocator.block_size)
        self.prefix_queries += len(hashes)
        table = self.tables[seq]
        for h in hashes:
            block = self.allocator.lookup(h)
            if block is None:
                break
            table.append(block)
            self.hashes[seq].append(h)
        hits = len(table)
        self.prefix_hits += hits
        self.lengths[seq] = hits * self.allocator.block_size
        self.token_ids[seq] = list(ids[:self.lengths[seq]])
        return hits

    def append(self, seq, tokens=1):
        """Room for `tokens` more tokens of `seq` (a count, or token ids under prefix caching): a new block
        when the last is full, a private copy of the last block when it is shared (copy-on-write).
        All or nothing on OutOfBlocks."""
        table, bs = self._table(seq), self.allocator.block_size
        count, ids = self._tokens(tokens, "tokens")
        length = self.lengths[seq]
        need = -(-(length + count) // bs) - len(table)
        cow = length % bs != 0 and count > 0 and self.allocator.ref_count[table[-1]] > 1
        if need + cow > self.allocator.num_free:
            raise OutOfBlocks(f"seq {seq!r} needs {need + cow} blocks, {self.allocator.num_free} are free")
        if cow:
            fresh = self.allocator.allocate()
            self.copies.append((table[-1], fresh))
            self.allocator.free(table[-1])
            table[-1] = fresh
        table.extend(self.allocator.allocate() for _ in range(need))
        self.lengths[seq] = length + count
        if self.prefix_caching:
            self._cache_full_blocks(seq, ids)

    def _cache_full_blocks(self, seq, ids):
        """Records the new tokens and names every block they filled by its chained hash."""
        bs, tokens, hashes = self.allocator.block_size, self.token_ids[seq], self.hashes[seq]
        tokens.extend(ids)
        parent = hashes[-1] if hashes else None
        new = block_hashes(tokens[len(hashes) * bs:], bs, parent)
        for i, h in enumerate(new, start=len(hashes)):
            self.allocator.cache(self.tables[seq][i], h)
        hashes.extend(new)

    def fork(self, parent, child):
        """`child` starts as `parent`, sharing every block (no copy until one of them writes)."""
        if child in self.tables or child in self.swapped:
            raise ValueError(f"seq {child!r} already exists")
        for block in self._table(parent):
            self.allocator.share(block)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]
        if self.prefix_caching:
            self.token_ids[child], self.hashes[child] = list(self.token_ids[parent]), list(self.hashes[parent])

    def free(self, seq):
        """Release every block of `seq`, on the device or swapped out. An unknown `seq` raises KeyError.
        Blocks go back last first, so that the LRU evictor drops a prefix's tail before its head."""
        if seq in self.swapped:
            for block in reversed(self.swapped.pop(seq)[0]):
                self.host.free(block)
        else:
            for block in reversed(self._table(seq)):
                self.allocator.free(block)
            del self.tables[seq], self.lengths[seq]
        self.token_ids.pop(seq, None)
        self.hashes.pop(seq, None)

    def take_copies(self):
        """The (src, dst) block copies that copy-on-write asked for since the last call; the engine performs
        them before this step's attention. Taking them empties the list, so it never grows without bound."""
        copies, self.copies = self.copies, []
        return copies

    # -- swapping ---------------------------------------------------------------------------------------
    def swap_out(self, *seqs):
        """Moves `seqs` (one group: blocks they share stay shared) to the host pool; returns the
        (device block, host block) copies to perform. All or nothing on OutOfBlocks."""
        if self.host is None:
            raise ValueError("swap_out needs a host pool: BlockTables(allocator, host=BlockAllocator(...))")
        owners = self._group_owners(seqs, self.tables, "on the device")
        if len(owners) > self.host.num_free:
            raise OutOfBlocks(f"host pool: {seqs!r} need {len(owners)} blocks, {self.host.num_free} are free")
        to_host = self._copy_blocks(owners, self.host)
        for seq in seqs:
            table = self.tables.pop(seq)
            self.swapped[seq] = ([to_host[block] for block in table], self.lengths.pop(seq))
            for block in reversed(table):
                self.allocator.free(block)       # cached blocks stay in the evictor: still valid on the device
        return list(to_host.items())

    def can_swap_in(self, *seqs):
        """NOW, LATER or NEVER for bringing `seqs` back, keeping the watermark free."""
        need = len(self._group_owners(seqs, {s: t for s, (t, _) in self.swapped.items()}, "swapped out"))
        if self.allocator.num_blocks - need < self.watermark_blocks:
            return NEVER
        return NOW if self.allocator.num_free - need >= self.watermark_blocks else LATER

    def swap_in(self, *seqs):
        """Brings swapped-out `seqs` back to the device; returns the (host block, device block) copies.
        All or nothing on OutOfBlocks."""
        owners = self._group_owners(seqs, {s: t for s, (t, _) in self.swapped.items()}, "swapped out")
        if len(owners) > self.allocator.num_free:
            raise OutOfBlocks(f"{seqs!r} need {len(owners)} blocks, {self.allocator.num_free} are free")
        to_device = self._copy_blocks(owners, self.allocator)
        for seq in seqs:
            table, length = self.swapped.pop(seq)
            self.tables[seq], self.lengths[seq] = [to_device[block] for block in table], length
            for block, block_hash in zip(self.tables[seq], self.hashes.get(seq, [])):
                self.allocator.cache(block, block_hash)     # full blocks findable again (unless another holds the hash)
            for block in reversed(table):
                self.host.free(block)
        return list(to_device.items())

    def _group_owners(self, seqs, tables, where):
        if not seqs:
            raise ValueError("name at least one sequence")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs must be distinct, got {seqs!r}")
        for seq in seqs:
            if seq not in tables:
                raise KeyError(f"seq {seq!r} is not {where}")
        return collections.Counter(block for seq in seqs for block in tables[seq])

    @staticmethod
    def _copy_blocks(owners, pool):
        """A block of `pool` for each block in `owners`, with as many owners: {old block: new block}."""
        mapping = {}
        for block, count in owners.items():
            mapping[block] = pool.allocate()
            for _ in range(count - 1):
                pool.share(mapping[block])
        return mapping

    # -- reading ----------------------------------------------------------------------------------------
    def slots(self, seq):
        """Physical slot (block * block_size + offset) of each of `seq`'s tokens, in order."""
        bs, table = self.allocator.block_size, self._table(seq)
        return [table[t // bs] * bs + t % bs for t in range(self.lengths[seq])]

    def _table(self, seq):
        if seq not in self.tables:
            where = "swapped out (swap_in first)" if seq in self.swapped else "unknown"
            raise KeyError(f"seq {seq!r} is {where}; known: {sorted(map(str, self.tables))[:10]}")
        return self.tables[seq]

    def _tokens(self, tokens, name):
        """(count, token ids or None): prefix caching needs the ids, otherwise a count will do."""
        if isinstance(tokens, numbers.Integral) and not isinstance(tokens, bool):
            if tokens < 0:
                raise ValueError(f"{name} must be >= 0, got {tokens!r}")
            if self.prefix_caching and tokens:
                raise ValueError(f"{name}: prefix caching needs the token ids, got the count {tokens!r}")
            return int(tokens), []
        if isinstance(tokens, (str, bytes, bool)) or not hasattr(tokens, "__len__"):
            raise TypeError(f"{name} must be a count or a sequence of token ids, got {tokens!r}")
        ids = _ids(tokens, name)
        return len(ids), ids

    @property
    def blocks_in_use(self):
        return self.allocator.num_blocks - self.allocator.num_free

    @property
    def tokens(self):
        """Tokens held on the device (swapped-out sequences not included)."""
        return sum(self.lengths.values())
