"""labkit.paged's first design (vLLM's block allocator and block tables): allocation, copy-on-write, loud errors, no
block lost under random operations; and the package's layers, each importing only those above it."""
import ast
import collections
import pathlib

import pytest
from hypothesis import given, settings, strategies as st

from labkit import paged
from labkit.paged import BlockAllocator, BlockTables, OutOfBlocks, block_hashes

ORDER = ["allocator", "tables", "admission", "swapping", "prefix", "serving"]   # the reading order of __init__
PACKAGE = pathlib.Path(paged.__file__).parent


def test_allocate_free_and_loud_errors():
    a = BlockAllocator(2, block_size=4)
    b0, b1 = a.allocate(), a.allocate()
    assert (b0, b1) == (0, 1) and a.num_free == 0
    with pytest.raises(OutOfBlocks, match="all 2 blocks of 4 tokens are in use"):
        a.allocate()
    a.free(b0)
    with pytest.raises(ValueError, match="Double free of block 0"):
        a.free(b0)
    with pytest.raises(ValueError, match=r"block must be an int in \[0, 2\), got 7"):
        a.free(7)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1, got 0"):
        BlockAllocator(0)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_a_block_size_below_one_is_refused(bad):
    with pytest.raises(ValueError, match=f"block_size must be an int >= 1, got {bad!r}"):
        BlockAllocator(8, bad)
    with pytest.raises(ValueError, match=f"block_size must be an int >= 1, got {bad!r}"):
        block_hashes([1, 2, 3, 4], bad)


def test_append_grows_by_blocks_and_slots_follow_the_table():
    t = BlockTables(BlockAllocator(8, block_size=4))
    t.add("a", 5)
    assert t.tables["a"] == [0, 1] and t.lengths["a"] == 5
    t.append("a", 3)
    assert t.tables["a"] == [0, 1]                      # 8 tokens still fit in 2 blocks
    t.append("a")
    assert t.tables["a"] == [0, 1, 2]
    assert t.slots("a")[:5] == [0, 1, 2, 3, 4] and t.slots("a")[-1] == 8


def test_fork_shares_and_copy_on_write():
    alloc = BlockAllocator(8, block_size=4)
    t = BlockTables(alloc)
    t.add("p", 6)                                       # blocks 0 (full) and 1 (half)
    t.fork("p", "c")
    assert alloc.ref_count[:2] == [2, 2] and t.blocks_in_use == 2
    t.append("c")                                       # writes into shared block 1: copy it first
    assert t.copies == [(1, 2)] and t.tables["c"] == [0, 2] and alloc.ref_count[:3] == [2, 1, 1]
    t.free("p")
    assert alloc.ref_count[:3] == [1, 0, 1] and 1 in alloc.free_list


def test_out_of_blocks_changes_nothing():
    t = BlockTables(BlockAllocator(2, block_size=4))
    t.add("a", 8)
    with pytest.raises(OutOfBlocks, match="needs 1 blocks, 0 are free"):
        t.append("a")
    assert t.lengths["a"] == 8 and t.tables["a"] == [0, 1]
    with pytest.raises(OutOfBlocks):
        t.add("b", 1)
    assert "b" not in t.tables, "a failed add leaves nothing behind"
    with pytest.raises(KeyError, match="seq 'zz' is unknown"):
        t.free("zz")
    with pytest.raises(ValueError, match="already exists"):
        t.add("a")


def test_numpy_integers_are_sizes_counts_and_block_ids():
    """lk.estimate takes np.int64 sizes; so does labkit.paged (a scheduler's sizes often come from numpy)."""
    import numpy as np
    from labkit.paged import block_hashes, serving_tables
    a = BlockAllocator(np.int64(4), np.int32(4))
    assert (a.num_blocks, a.block_size) == (4, 4) and type(a.num_blocks) is int
    block = a.allocate()
    a.share(np.int64(block))
    a.free(np.int64(block))
    a.free(np.int64(block))
    assert a.free_list[-1] == block and type(a.free_list[-1]) is int
    t = serving_tables(BlockAllocator(8, 4), watermark=np.float64(0.25))
    t.add("a", np.int64(5))
    t.append("a", np.int64(3))
    assert t.lengths["a"] == 8 and t.watermark_blocks == 2
    assert block_hashes(np.arange(8), np.int64(4)) == block_hashes(list(range(8)), 4)


ops = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free"]), st.integers(0, 7), st.integers(0, 9)),
               max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 5))
def test_no_block_lost_or_double_counted(operations, block_size):
    alloc = BlockAllocator(12, block_size)
    t = BlockTables(alloc)
    for op, seq, n in operations:
        try:
            if op == "add":
                t.add(seq, n)
            elif op == "append":
                t.append(seq, n)
            elif op == "fork":
                t.fork(seq, n + 100)
            else:
                t.free(seq)
        except (KeyError, ValueError, OutOfBlocks):
            pass
        owners = collections.Counter(b for table in t.tables.values() for b in table)
        assert all(alloc.ref_count[b] == owners.get(b, 0) for b in range(alloc.num_blocks))
        assert sorted(alloc.free_list) == [b for b in range(alloc.num_blocks) if owners.get(b, 0) == 0]
        for s, table in t.tables.items():
            assert len(table) == -(-t.lengths[s] // block_size)


# ---- the layers on top: each imports only those above it; the first design knows none of them ----------
def imports_of(name):
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}


@pytest.mark.parametrize("name", ORDER)
def test_each_layer_imports_only_the_layers_above_it(name):
    above = set(ORDER[:ORDER.index(name)])
    assert imports_of(name) <= above, f"{name} imports {imports_of(name) - above}, below it or beside it"
    assert len((PACKAGE / f"{name}.py").read_text().splitlines()) < 200, f"{name}.py: one idea, a few screens"


def test_the_first_design_is_short_and_knows_nothing_of_the_layers():
    source = (PACKAGE / "allocator.py").read_text()
    code = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith(("#", '"'))]
    assert len(source.splitlines()) < 70, "vLLM's first allocator is a screen"
    for later in ("evictor", "hash", "watermark", "swap", "host"):
        assert later not in source, f"allocator.py mentions {later!r}: that belongs to a layer on top"
    assert code, "the allocator has code"
    a = BlockAllocator(4, 4)
    assert not hasattr(a, "evictor") and not hasattr(BlockTables(a), "can_allocate")
