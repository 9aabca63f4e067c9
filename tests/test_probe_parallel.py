"""A hostile caller's probe of labkit.collectives.process_group_calls (one gloo rank).

Nesting, an exception inside, collectives after exit, a keyword call and blocks closed out of order."""
import pytest
import torch
import torch.distributed as dist

from labkit.collectives import process_group_calls


@pytest.fixture
def group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    original = dict(vars(dist.ProcessGroup))
    try:
        yield original
    finally:
        dist.destroy_process_group()


def _restored(original):
    return all(vars(dist.ProcessGroup).get(name) is method for name, method in original.items())


def test_nested_counters_each_count_their_own_calls_and_an_exception_restores_the_methods(group):
    x = torch.ones(1000)                                       # 4000 bytes
    with process_group_calls() as outer:
        with process_group_calls() as inner:
            dist.all_reduce(x)
        dist.all_reduce(x)
    assert (outer["all_reduce"], outer["calls"], inner["all_reduce"], inner["calls"]) == (8000, 2, 4000, 1)
    with pytest.raises(RuntimeError, match="inside"):
        with process_group_calls():
            raise RuntimeError("inside")
    assert _restored(group)
    dist.all_reduce(x, async_op=True).wait()                   # still bound after exit


def test_a_keyword_call_to_the_process_group_is_counted(group):
    pg = dist.distributed_c10d._get_default_group()
    with process_group_calls() as pg_calls:
        pg.allreduce(tensors=[torch.ones(10)]).wait()
    assert pg_calls["all_reduce"] == 40


def test_contexts_exited_out_of_order_leave_the_process_group_unpatched(group):
    first, second = process_group_calls(), process_group_calls()
    counts = first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    dist.all_reduce(torch.ones(10))
    assert _restored(group) and counts["calls"] == 0
