"""labkit.paged is the first design plus layers: each module imports only the ones above it, and the first
design knows nothing of the layers (issue 29)."""
import ast
import pathlib

import pytest

from labkit import paged
from labkit.paged import BlockAllocator, BlockTables, PrefixCachingAllocator, serving_tables

ORDER = ["allocator", "tables", "admission", "swapping", "prefix", "serving"]   # the reading order of __init__
PACKAGE = pathlib.Path(paged.__file__).parent


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


def test_the_layers_refuse_what_they_cannot_serve():
    with pytest.raises(TypeError, match="prefix caching needs a PrefixCachingAllocator, got BlockAllocator"):
        serving_tables(BlockAllocator(4, 4), prefix_caching=True)
    with pytest.raises(TypeError, match="watermark"):
        BlockTables(BlockAllocator(4, 4), watermark=0.1)        # the first design has no admission control
    t = serving_tables(PrefixCachingAllocator(8, 4), host=BlockAllocator(4, 4), watermark=0.25, prefix_caching=True)
    assert t.prefix_caching and t.watermark_blocks == 2 and t.host.num_blocks == 4
    assert [cls.__name__ for cls in type(t).__mro__[:5]] == [
        "PrefixServingTables", "PrefixCachingTables", "SwappingTables", "WatermarkTables", "BlockTables"]


def test_a_sequence_swapped_back_in_names_its_blocks_again():
    """The one place two layers meet (serving.py): after a swap out and in, a new request finds the prefix."""
    device = PrefixCachingAllocator(4, 4)
    t = serving_tables(device, host=BlockAllocator(4, 4), prefix_caching=True)
    t.add("a", list(range(8)))
    t.swap_out("a")
    t.add("filler", list(range(100, 116)))          # takes every device block: the cached ones are evicted
    assert not set(t.hashes["a"]) & set(device.cached), "a's names are gone from the device"
    t.free("filler")
    t.swap_in("a")
    assert set(t.hashes["a"]) <= set(device.cached)
    assert t.add("b", list(range(8)) + [9]) == 8, "a's blocks are named again on the device"
