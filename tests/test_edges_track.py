"""lk.track at its edges: storage resize_ (how FSDP frees parameters), compiled code, nesting."""
import pytest
import torch

import labkit as lk


def test_storage_resize_inside_the_block_is_counted():
    """FSDP frees a parameter with untyped_storage().resize_(0) and refills it the same way: the books follow."""
    w = torch.nn.Parameter(torch.zeros(1024))               # 4 KiB, passed in: counted from the start
    with lk.track(w) as mem:
        w.untyped_storage().resize_(0)
        freed = mem.live
        w.untyped_storage().resize_(4096 * 4)                # grown to 16 KiB
    assert (freed, mem.live, mem.peak) == (0, 16384, 16384)
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_, "the wrapper is gone after the block"


def test_compiled_code_is_refused_naming_the_users_function_only():
    @torch.compile(backend="eager")
    def double_sin(x):
        return (x * 2).sin()

    x = torch.randn(64)
    double_sin(x)
    with pytest.raises(RuntimeError, match=r"so double_sin ran eagerly") as err:
        with lk.track():
            y = double_sin(x)
            del y                                         # a storage freed while Dynamo is watching
    assert "_free" not in str(err.value)


def test_dispatch_trackers_nest_and_each_counts_on_its_own():
    with lk.track() as outer:
        a = torch.zeros(1000)                              # 4000 B
        with lk.track() as inner:
            b = torch.zeros(2000)                          # 8000 B
        del b
    assert (outer.peak, inner.peak, inner.live, outer.live) == (12000, 8000, 8000, 4000)
    del a


def test_a_profiler_tracker_does_not_nest():
    with lk.track():
        with pytest.raises(RuntimeError, match="backend='profiler'\\) does not nest"):
            with lk.track(backend="profiler"):
                pass
    with lk.track(backend="profiler"):
        with pytest.raises(RuntimeError, match="does not nest"):
            with lk.track():
                pass
