"""Block tables over a `BlockAllocator`: each sequence's list of physical blocks, in token order.

The first design of vLLM's block manager: `add` a sequence with its prompt, `append` tokens as it
decodes (a new block only when the last one is full), `fork` a child that shares every block of its
parent (parallel sampling, beam search), `free` it when done. A write into a block that another sequence
also owns first copies it (copy-on-write); the copies wait in `copies` until the engine takes them,
once per step, with `take_copies()`.

Token t of `seq` lives at slot `tables[seq][t // block_size] * block_size + t % block_size` of a pool of
`num_blocks * block_size` slots (`slots(seq)`): the layout `labkit.flash.paged_attention` reads.
"""
import numbers
import operator

from ..checks import count
from .allocator import BlockAllocator, OutOfBlocks

__all__ = ["BlockTables", "as_token_ids", "blocks_for"]


def blocks_for(tokens, block_size):
    """Blocks that hold `tokens` tokens: ceil(tokens / block_size)."""
    return -(-tokens // block_size)


def as_token_ids(tokens, name):
    """Token ids as a list of ints: whole numbers only (1.7 is not a token id), one flat sequence."""
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):
        raise TypeError(f"{name} must be a sequence of token ids, got {tokens!r}")
    ids = []
    for i, token in enumerate(tokens):
        try:
            if isinstance(token, bool):
                raise TypeError
            ids.append(operator.index(token))
        except TypeError:
            raise TypeError(f"{name}[{i}] must be an int token id, got {token!r}") from None
    return ids


class BlockTables:
    """Per-sequence block tables over one allocator: add, append, fork (copy-on-write), free."""

    prefix_caching = False          # PrefixCachingTables says True

    def __init__(self, allocator):
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.tables, self.lengths = {}, {}         # seq -> [physical block, ...], seq -> tokens held
        self.copies = []                           # (src, dst) copies that copy-on-write asked for, not yet taken

    def add(self, seq, tokens=0):
        """A new sequence holding `tokens` (its prompt: a count, or token ids). All or nothing.
        Returns how many of its tokens were already cached: always 0 here (prefix caching finds some)."""
        self.check_new(seq)
        count, _ = self.count_tokens(tokens)
        need = self.new_blocks(tokens)
        if need > self.allocator.num_free:         # all or nothing: checked before anything changes
            raise OutOfBlocks(f"seq {seq!r} needs {need} blocks, {self.allocator.num_free} are free")
        self.tables[seq], self.lengths[seq] = [], 0
        self.append(seq, count)
        return 0

    def append(self, seq, tokens=1):
        """Room for `tokens` more tokens of `seq` (a count, or token ids): a new block when the last is
        full, a private copy of the last block when it is shared (copy-on-write). All or nothing."""
        table, bs = self.table(seq), self.allocator.block_size
        count, _ = self.count_tokens(tokens)
        length = self.lengths[seq]
        need = blocks_for(length + count, bs) - len(table)
        cow = length % bs != 0 and count > 0 and self.allocator.ref_count[table[-1]] > 1
        if need + cow > self.allocator.num_free:
            raise OutOfBlocks(f"seq {seq!r} needs {need + cow} blocks, {self.allocator.num_free} are free")
        if cow:                                    # the last block is shared and partly filled: copy, then write
            fresh = self.allocator.allocate()
            self.copies.append((table[-1], fresh))
            self.allocator.free(table[-1])
            table[-1] = fresh
        for _ in range(need):
            table.append(self.allocator.allocate())
        self.lengths[seq] = length + count

    def fork(self, parent, child):
        """`child` starts as `parent`, sharing every block (no copy until one of them writes)."""
        self.check_new(child)
        for block in self.table(parent):
            self.allocator.share(block)
        self.tables[child], self.lengths[child] = list(self.tables[parent]), self.lengths[parent]

    def free(self, seq):
        """Release every block of `seq`, last first. An unknown `seq` raises KeyError (a scheduler bug)."""
        for block in reversed(self.table(seq)):
            self.allocator.free(block)
        del self.tables[seq], self.lengths[seq]

    def take_copies(self):
        """The (src, dst) block copies copy-on-write asked for since the last call; the engine performs them
        before this step's attention. Taking them empties the list, so it never grows without bound."""
        copies, self.copies = self.copies, []
        return copies

    def slots(self, seq):
        """Physical slot (block * block_size + offset) of each of `seq`'s tokens, in order."""
        bs, table = self.allocator.block_size, self.table(seq)
        return [table[t // bs] * bs + t % bs for t in range(self.lengths[seq])]

    # -- helpers the layers on top extend ---------------------------------------------------------------
    def new_blocks(self, tokens):
        """Blocks `add(seq, tokens)` takes from the pool."""
        return blocks_for(self.count_tokens(tokens)[0], self.allocator.block_size)

    def table(self, seq):
        """`seq`'s block table; KeyError naming it if it is not here."""
        if seq not in self.tables:
            raise KeyError(f"seq {seq!r} is unknown; known: {sorted(map(str, self.tables))[:10]}")
        return self.tables[seq]

    def check_new(self, seq):
        if seq in self.tables:
            raise ValueError(f"seq {seq!r} already exists")

    def count_tokens(self, tokens, name="tokens"):
        """(count, token ids), the ids None when `tokens` is a count."""
        if isinstance(tokens, numbers.Integral) and not isinstance(tokens, bool):
            return count(name, tokens, 0), None
        if isinstance(tokens, (str, bytes, bool)) or not hasattr(tokens, "__len__"):
            raise TypeError(f"{name} must be a count or a sequence of token ids, got {tokens!r}")
        ids = as_token_ids(tokens, name)
        return len(ids), ids

    @property
    def blocks_in_use(self):
        return self.allocator.num_blocks - self.allocator.num_free

    @property
    def tokens(self):
        """Tokens held in the pool."""
        return sum(self.lengths.values())
