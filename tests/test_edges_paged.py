"""paged at its edges: token ids that are not ids, bad block sizes, sharing a free block."""
import numpy as np
import pytest
import torch

from labkit.paged import BlockAllocator, BlockTables, PrefixCachingAllocator, block_hashes, serving_tables


@pytest.mark.parametrize("tokens, says", [
    ([[1, 2], [3, 4]], r"tokens\[0\] must be an int token id, got \[1, 2\]"),
    ([1, 2.7, 3], r"tokens\[1\] must be an int token id, got 2.7"),
    ([1, True], r"tokens\[1\] must be an int token id, got True"),
    ("abc", "tokens must be a count or a sequence of token ids, got 'abc'"),
])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_token_ids_that_are_not_ids_are_refused_and_nothing_changes(tokens, says, prefix_caching):
    tables = serving_tables((PrefixCachingAllocator if prefix_caching else BlockAllocator)(8, 4), prefix_caching=prefix_caching)
    with pytest.raises(TypeError, match=says):
        tables.add("a", tokens)
    assert tables.tables == {} and tables.allocator.num_free == 8


def test_integer_ids_from_numpy_and_torch_are_ids():
    tables = serving_tables(PrefixCachingAllocator(8, 4), prefix_caching=True)
    assert tables.add("a", np.arange(8)) == 0
    assert tables.add("b", torch.arange(9)) == 8          # the same two full blocks, found in the cache
    with pytest.raises(TypeError, match=r"tokens\[0\] must be an int token id, got tensor\(0.5000\)"):
        tables.add("c", torch.tensor([0.5]))


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_a_block_size_below_one_is_refused(bad):
    with pytest.raises(ValueError, match=f"block_size must be an int >= 1, got {bad!r}"):
        BlockAllocator(8, bad)
    with pytest.raises(ValueError, match=f"block_size must be an int >= 1, got {bad!r}"):
        block_hashes([1, 2, 3, 4], bad)


def test_sharing_a_free_block_is_not_called_a_double_free():
    a = PrefixCachingAllocator(4, 4)
    with pytest.raises(ValueError, match="cannot share block 2: it is free"):
        a.share(2)
    with pytest.raises(ValueError, match="cannot cache block 1: it is free"):
        a.cache(1, 123)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match=f"Double free of block {b}"):
        a.free(b)
