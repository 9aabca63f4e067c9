"""Prefix caching on top of block tables: full blocks named by a hash of their tokens and of their prefix.

After vLLM's automatic prefix caching (v0.4 on). A full block is named by `block_hashes`, a hash of its
tokens chained with the hash of the block before it; a new sequence whose leading blocks are already named
shares them through the reference counts, as a fork would. A named block whose last owner leaves is kept,
free but cached, in the allocator's LRU `evictor`, and handed out again only when the free list is empty.
The tables need the token ids (not counts) to name blocks.

Two rules of vLLM's that a first reading can skip:
- a prompt found whole in the cache still computes its last block: the model needs the last token's logits
  to sample the next one (vLLM v1 caps a hit at the prompt's length - 1 tokens, `get_computed_blocks`);
- a block that fills up with tokens whose hash already names another block is given back, and the table
  points to that twin instead (vLLM v0's `promote_to_immutable_block`): one copy of the same keys and values.
"""
import collections

from ..checks import count
from .allocator import BlockAllocator, OutOfBlocks
from .tables import BlockTables, as_token_ids

__all__ = ["block_hashes", "PrefixCachingAllocator", "PrefixCachingTables"]


def block_hashes(token_ids, block_size, parent=None):
    """The hash of each full block of `token_ids`: `hash((previous block's hash, block's tokens))`.

    The first block's previous hash is `parent` (None). Chaining makes a hash name a block's tokens AND
    everything before them: the same tokens after another prefix have other keys and values.
    """
    block_size = count("block_size", block_size)
    ids = as_token_ids(token_ids, "token_ids")
    hashes = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixCachingAllocator(BlockAllocator):
    """A BlockAllocator that also maps hashes to the full blocks holding them (`cached`, `hash_of`).
    A named block whose count falls to 0 waits in `evictor` (least recently freed first) instead of the
    free list, and is handed out again (its name forgotten) only when the free list is empty."""

    def __init__(self, num_blocks, block_size=16):
        super().__init__(num_blocks, block_size)
        self.cached, self.hash_of = {}, {}                       # hash -> block, block -> hash
        self.evictor = collections.OrderedDict()                 # free but named blocks, LRU first
        self.evictions = 0

    def allocate(self):
        """A free block: from the free list, else the least recently used named one (its name forgotten)."""
        if self.free_list or not self.evictor:
            return super().allocate()
        block, _ = self.evictor.popitem(last=False)
        del self.cached[self.hash_of.pop(block)]
        self.evictions += 1
        self.ref_count[block] = 1
        return block

    def free(self, block):
        """One owner fewer; a named block with none left goes to the evictor, keeping its name."""
        block = self.check(block)
        if self.ref_count[block] == 1 and block in self.hash_of:
            self.ref_count[block] = 0
            self.evictor[block] = None
        else:
            super().free(block)

    def cache(self, block, block_hash):
        """Names the full, allocated `block` by its hash so that later sequences can share it. False (and
        nothing changes) when the hash already names another block or the block has a name."""
        block = self.check(block, "cache")
        if block_hash in self.cached or block in self.hash_of:
            return False
        self.cached[block_hash], self.hash_of[block] = block, block_hash
        return True

    def promote(self, block, block_hash):
        """The block a table should hold for the full, private `block` named `block_hash`: `block` itself, now
        named, or, when the hash already names a twin (the same tokens after the same prefix), the twin with
        one more owner, and `block` goes back to the pool (vLLM v0's promote_to_immutable_block)."""
        twin = self.cached.get(block_hash)
        if twin is None or twin == block:
            self.cache(block, block_hash)
            return block
        self.lookup(block_hash)
        self.free(block)
        return twin

    def lookup(self, block_hash):
        """The block named `block_hash` with one more owner (out of the evictor if it was free), or None."""
        block = self.cached.get(block_hash)
        if block is not None:
            if self.ref_count[block] == 0:
                del self.evictor[block]
            self.ref_count[block] += 1
        return block

    @property
    def num_free(self):
        """Blocks that `allocate` can hand out: the free list and the free-but-named ones."""
        return len(self.free_list) + len(self.evictor)


class PrefixCachingTables(BlockTables):
    """Block tables whose sequences share the leading full blocks that another sequence already filled."""

    prefix_caching = True

    def __init__(self, allocator, **options):
        if not isinstance(allocator, PrefixCachingAllocator):
            raise TypeError(f"prefix caching needs a PrefixCachingAllocator, got {type(allocator).__name__}")
        super().__init__(allocator, **options)
        self.token_ids, self.hashes = {}, {}       # each sequence's tokens and its full blocks' hashes
        self.prefix_queries = self.prefix_hits = 0     # full prompt blocks looked up / found in the cache

    def add(self, seq, tokens=()):
        """A new sequence holding the token ids `tokens`, its leading cached blocks shared. Returns how
        many of its tokens were found in the cache (never all: see `reusable`). All or nothing."""
        self.check_new(seq)
        _, ids = self.count_tokens(tokens)
        need = self.new_blocks(ids)                # a free named block found costs a block: it leaves the evictor
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"seq {seq!r} needs {need} blocks, {self.allocator.num_free} are free")
        self.tables[seq], self.lengths[seq], self.token_ids[seq], self.hashes[seq] = [], 0, [], []
        hits = self.reuse_cached_prefix(seq, ids)
        self.append(seq, ids[hits * self.allocator.block_size:])
        return hits * self.allocator.block_size

    def reuse_cached_prefix(self, seq, ids):
        """Shares the longest run of leading full blocks already cached, short of the last token; the number of
        blocks reused."""
        self.prefix_queries += len(block_hashes(ids, self.allocator.block_size))
        table = self.tables[seq]
        for h in self.reusable(ids):
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

    def append(self, seq, tokens=()):
        """Room for the token ids `tokens`; every block they fill is named by its chained hash."""
        _, ids = self.count_tokens(tokens)
        super().append(seq, ids)
        bs, seen, hashes = self.allocator.block_size, self.token_ids[seq], self.hashes[seq]
        seen.extend(ids)
        new = block_hashes(seen[len(hashes) * bs:], bs, hashes[-1] if hashes else None)
        table = self.tables[seq]
        for i, h in enumerate(new, start=len(hashes)):
            block = self.allocator.promote(table[i], h)
            if block != table[i]:                  # given back: a copy into it (copy-on-write) is not needed
                self.copies = [(src, dst) for src, dst in self.copies if dst != table[i]]
                table[i] = block
        hashes.extend(new)

    def fork(self, parent, child):
        super().fork(parent, child)
        self.token_ids[child], self.hashes[child] = list(self.token_ids[parent]), list(self.hashes[parent])

    def free(self, seq):
        """Release `seq`'s blocks last first, so that the LRU evictor drops a prefix's tail before its head."""
        super().free(seq)
        del self.token_ids[seq], self.hashes[seq]

    def new_blocks(self, tokens):
        """Blocks `add` takes from the pool: cached blocks that other sequences hold cost nothing."""
        _, ids = self.count_tokens(tokens)
        in_use = 0
        for h in self.reusable(ids):
            block = self.allocator.cached.get(h)
            if block is None:
                break
            in_use += self.allocator.ref_count[block] > 0
        return super().new_blocks(ids) - in_use

    def reusable(self, ids):
        """The hashes of the blocks of prompt `ids` that a lookup may share: its full blocks, short of its last
        token, whose logits sample the next token (a prompt of whole blocks computes its last block again)."""
        return block_hashes(ids, self.allocator.block_size)[:(len(ids) - 1) // self.allocator.block_size]

    def count_tokens(self, tokens, name="tokens"):
        """(count, token ids): a count other than 0 is refused, since blocks are named by their tokens."""
        count, ids = super().count_tokens(tokens, name)
        if ids is None:
            if count:
                raise ValueError(f"{name}: prefix caching needs the token ids, got the count {tokens!r}")
            ids = []
        return count, ids
