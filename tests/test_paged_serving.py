"""labkit.paged beyond the first design: admission, swapping, prefix caching, copies taken per step."""
import collections

import pytest
from hypothesis import given, settings, strategies as st

from labkit.paged import (LATER, NEVER, NOW, BlockAllocator, BlockTables, OutOfBlocks, PrefixCachingAllocator,
                          block_hashes, serving_tables)


def test_can_allocate_now_later_never_with_a_watermark():
    t = serving_tables(BlockAllocator(10, block_size=4), watermark=0.2)          # 2 blocks kept free
    assert t.watermark_blocks == 2
    assert t.can_allocate(8 * 4) == NOW                                      # 8 blocks, 2 left
    assert t.can_allocate(8 * 4 + 1) == NEVER                                # 9 blocks: never with 2 kept free
    t.add("a", 5 * 4)
    assert t.can_allocate(3 * 4) == NOW and t.can_allocate(4 * 4) == LATER
    t.free("a")
    assert t.can_allocate(4 * 4) == NOW
    t.add("b", 8 * 4)
    t.append("b", 2 * 4)                                                     # running sequences may use the watermark
    assert t.allocator.num_free == 0 and t.can_allocate(1) == LATER
    assert serving_tables(BlockAllocator(4, 4)).can_allocate(16) == NOW         # no watermark: the whole pool


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="watermark must be a fraction of the blocks in \\[0, 1\\), got 1.5"):
        serving_tables(BlockAllocator(4), watermark=1.5)
    with pytest.raises(ValueError, match="host must be a BlockAllocator with block_size 16"):
        serving_tables(BlockAllocator(4), host=BlockAllocator(4, block_size=8))
    with pytest.raises(TypeError, match="allocator must be a BlockAllocator, got int"):
        BlockTables(4)
    t = serving_tables(BlockAllocator(4, 4))
    with pytest.raises(ValueError, match="tokens must be >= 0, got -1"):
        t.add("a", -1)
    with pytest.raises(TypeError, match="tokens must be a count or a sequence of token ids, got 'abc'"):
        t.add("a", "abc")
    with pytest.raises(ValueError, match="prefix caching needs the token ids, got the count 5"):
        serving_tables(PrefixCachingAllocator(4, 4), prefix_caching=True).add("a", 5)
    with pytest.raises(ValueError, match="swap_out needs a host pool"):
        t.add("a", 1) or t.swap_out("a")


def test_freeing_an_unknown_or_freed_sequence_raises():
    t = BlockTables(BlockAllocator(4, 4))
    t.add("a", 3)
    t.free("a")
    with pytest.raises(KeyError, match="seq 'a' is unknown"):
        t.free("a")
    with pytest.raises(KeyError, match="seq 'never' is unknown"):
        t.free("never")


def test_copies_are_taken_once_per_step():
    t = BlockTables(BlockAllocator(8, block_size=4))
    t.add("p", 6)
    t.fork("p", "c")
    t.append("c")
    assert t.take_copies() == [(1, 2)] and t.copies == [] and t.take_copies() == []
    t.fork("c", "d")
    t.append("d")
    assert t.take_copies() == [(2, 3)], "only this step's copies"


def test_swap_out_and_in_keeps_tokens_sharing_and_counts():
    gpu, host = BlockAllocator(6, 4), BlockAllocator(4, 4)
    t = serving_tables(gpu, host=host)
    t.add("p", 6)                                    # blocks 0, 1
    t.fork("p", "c")                                 # shares both
    t.add("x", 4)                                    # block 2
    out = t.swap_out("p", "c")
    assert out == [(0, 0), (1, 1)], "one copy per distinct block: the group's sharing survives"
    assert host.ref_count[:2] == [2, 2] and gpu.num_free == 5 and "p" not in t.tables and t.tokens == 4
    with pytest.raises(KeyError, match="swapped out"):
        t.append("p")
    t.add("y", 12)                                   # takes 3 device blocks while p and c are away
    assert t.can_swap_in("p", "c") == NOW
    back = t.swap_in("p", "c")
    assert [h for h, _ in back] == [0, 1] and t.tables["p"] == t.tables["c"] and t.lengths["c"] == 6
    assert host.num_free == 4 and gpu.ref_count[t.tables["p"][0]] == 2
    assert t.swapped == {}


def test_swap_is_all_or_nothing():
    t = serving_tables(BlockAllocator(4, 4), host=BlockAllocator(1, 4))
    t.add("a", 8)
    with pytest.raises(OutOfBlocks, match="host pool"):
        t.swap_out("a")
    assert t.tables["a"] == [0, 1] and t.host.num_free == 1
    t2 = serving_tables(BlockAllocator(2, 4), host=BlockAllocator(4, 4))
    t2.add("a", 8)
    t2.swap_out("a")
    t2.add("b", 4)
    assert t2.can_swap_in("a") == LATER
    with pytest.raises(OutOfBlocks):
        t2.swap_in("a")
    assert "a" in t2.swapped and t2.host.num_free == 2
    t2.free("a")                                     # freeing a swapped-out sequence frees its host blocks
    assert t2.host.num_free == 4 and t2.swapped == {}


def test_block_hashes_chain_the_prefix():
    assert len(block_hashes(range(10), 4)) == 2, "only full blocks"
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1], "the same tokens after another prefix are another block"
    assert block_hashes([5, 6, 7, 8], 4, parent=a[0]) == a[1:]


def test_prefix_caching_shares_full_blocks_and_evicts_lru():
    alloc = PrefixCachingAllocator(6, block_size=4)
    t = serving_tables(alloc, prefix_caching=True)
    system = list(range(100, 108))                                   # two full blocks
    assert t.add("a", system + [1, 2]) == 0
    assert t.add("b", system + [3]) == 8, "both system blocks found"
    assert t.tables["a"][:2] == t.tables["b"][:2] and alloc.ref_count[:3] == [2, 2, 1]
    assert (t.prefix_queries, t.prefix_hits) == (4, 2)
    t.free("a")
    t.free("b")
    assert len(alloc.evictor) == 2 and alloc.num_free == 6, "free but cached: counted free, kept for a hit"
    assert list(alloc.evictor) == [1, 0], "the tail block first: evicted before its prefix"
    assert t.add("c", system) == 8 and alloc.ref_count[:2] == [1, 1]
    t.free("c")
    tail, head = alloc.hash_of[1], alloc.hash_of[0]
    t.add("d", list(range(20)))                                     # 5 blocks: the free list (4) then the LRU one
    assert alloc.evictions == 1 and tail not in alloc.cached and alloc.cached[head] == 0
    t.free("d")
    assert t.add("e", system[:4] + [0]) == 4, "block 0 survived the eviction"


def test_prefix_cache_counts_only_blocks_in_use_as_free_to_share():
    alloc = PrefixCachingAllocator(3, block_size=4)
    t = serving_tables(alloc, prefix_caching=True)
    t.add("a", list(range(8)))
    assert t.can_allocate(list(range(8)) + [9]) == NOW, "2 shared blocks + 1 new fit in the 1 free"
    assert t.can_allocate(list(range(50, 58))) == LATER
    t.add("b", list(range(8)) + [9])
    with pytest.raises(OutOfBlocks):
        t.add("c", list(range(60, 64)))
    assert "c" not in t.tables and (t.prefix_queries, t.prefix_hits) == (4, 2), "a refused add counts nothing"


def test_prefix_blocks_are_named_as_they_fill():
    alloc = PrefixCachingAllocator(8, block_size=4)
    t = serving_tables(alloc, prefix_caching=True)
    t.add("a", [1, 2, 3])
    t.append("a", [4])                                              # fills block 0 during decoding
    t.append("a", [5, 6, 7, 8, 9])
    assert t.hashes["a"] == block_hashes(range(1, 10), 4) and len(alloc.cached) == 2
    assert t.add("b", list(range(1, 9))) == 8


def invariants(t):
    """No block lost or counted twice, on the device and on the host."""
    for pool, tables in ((t.allocator, t.tables), (t.host, {s: tb for s, (tb, _) in t.swapped.items()})):
        owners = collections.Counter(b for table in tables.values() for b in table)
        assert all(pool.ref_count[b] == owners.get(b, 0) for b in range(pool.num_blocks))
        evictor, cached, hash_of = (getattr(pool, name, {}) for name in ("evictor", "cached", "hash_of"))
        free = sorted(pool.free_list + list(evictor))
        assert free == [b for b in range(pool.num_blocks) if owners.get(b, 0) == 0], "free = unowned, each once"
        assert not set(pool.free_list) & set(evictor)
        assert set(evictor) <= set(hash_of) and {cached[h] for h in cached} == set(hash_of)
        assert all(hash_of[b] == h for h, b in cached.items())
    bs = t.allocator.block_size
    for s, table in t.tables.items():
        assert len(table) == -(-t.lengths[s] // bs)
    for s, (table, length) in t.swapped.items():
        assert len(table) == -(-length // bs)
    if t.prefix_caching:                                            # a named block holds the tokens its hash says
        for s, table in t.tables.items():
            assert t.hashes[s] == block_hashes(t.token_ids[s], bs)
            for block, h in zip(table, t.hashes[s]):
                assert t.allocator.hash_of.get(block, h) == h


ops = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "swap_out", "swap_in"]),
                         st.integers(0, 5), st.integers(0, 9), st.integers(0, 2)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 4), st.booleans())
def test_no_block_lost_or_double_counted_with_swapping_and_prefix_sharing(operations, block_size, caching):
    device = (PrefixCachingAllocator if caching else BlockAllocator)(10, block_size)
    t = serving_tables(device, host=BlockAllocator(6, block_size), prefix_caching=caching)
    for op, seq, n, prompt in operations:
        tokens = [prompt] * n if caching else n          # three prompts that share prefixes with each other
        try:
            if op == "add":
                t.add(seq, tokens)
            elif op == "append":
                t.append(seq, [seq] * n if caching else n)
            elif op == "fork":
                t.fork(seq, n + 100)
            elif op == "free":
                t.free(seq)
            elif op == "swap_out":
                t.swap_out(seq) if n % 2 else t.swap_out(*[s for s in t.tables if s == seq or s == seq + 100])
            else:
                t.swap_in(seq)
        except (KeyError, ValueError, OutOfBlocks):
            pass
        invariants(t)
