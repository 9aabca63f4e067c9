"""labkit.collectives.process_group_calls counts what the process group is asked to send, whoever asks (one gloo rank)."""
import torch
import torch.distributed as dist

from labkit.collectives import process_group_calls


def test_each_collective_is_counted_in_the_process_group_itself():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        x = torch.ones(1000)                                    # 4000 bytes
        with process_group_calls() as pg:
            dist.all_reduce(x)
            dist.reduce_scatter_tensor(torch.empty(1000), x)   # input: 4000 bytes
            dist.all_gather_into_tensor(torch.empty(1000), x)  # output: 4000 bytes
            x.add_(1)                                          # not a collective: not counted
        assert pg == {"all_reduce": 4000, "reduce_scatter": 4000, "all_gather": 4000, "calls": 3}
        with process_group_calls() as after:
            pass
        assert after["calls"] == 0, "the methods are restored on exit"
        dist.all_reduce(x)                                     # and still bound: collectives work afterwards
        dist.reduce_scatter_tensor(torch.empty(1000), x)
        dist.all_gather_into_tensor(torch.empty(1000), x)
    finally:
        dist.destroy_process_group()


def test_the_list_forms_are_counted_too():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        x = torch.ones(250)                                    # 1000 bytes
        with process_group_calls() as pg:
            dist.all_gather([torch.empty(250)], x)             # output list: 1000 bytes
            dist.all_reduce_coalesced([x, x]) if hasattr(dist, "all_reduce_coalesced") else dist.all_reduce(x)
        assert pg["all_gather"] == 1000 and pg["all_reduce"] in (1000, 2000) and pg["calls"] == 2
    finally:
        dist.destroy_process_group()
