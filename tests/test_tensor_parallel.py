"""labkit.tensor_parallel: Megatron's column- and row-parallel layers (a bias kept), one rank's share of a sharded
Llama, and the Adam-step check its torchrun script makes (the two-rank run itself: test_pipeline_parallel.py, one
torchrun for both scripts)."""
import pytest
import torch

import labkit as lk
from labkit import tensor_parallel
from labkit.launch import fake_ranks
from labkit.scripts.tensor_parallel import assert_same_adam_step
from labkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def test_column_and_row_parallel_keep_a_bias(monkeypatch):
    """Two ranks simulated in one process (the all-reduce replaced by a sum over the two partial outputs):
    column-parallel shards the bias with the output features, row-parallel adds it once after the sum.
    Tolerance: fp32 sums in a different order, 1e-6."""
    torch.manual_seed(0)
    col, row, x = torch.nn.Linear(8, 6), torch.nn.Linear(6, 8), torch.randn(3, 8)
    shards = [ColumnParallelLinear(col, r, 2) for r in range(2)]
    torch.testing.assert_close(torch.cat([s(x) for s in shards], -1), col(x), rtol=0, atol=1e-6)
    rows = [RowParallelLinear(row, r, 2) for r in range(2)]
    h = col(x)
    parts = [torch.nn.functional.linear(h.chunk(2, -1)[r], rows[r].weight) for r in range(2)]
    monkeypatch.setattr(tensor_parallel, "reduce_from_parallel", lambda y: sum(parts))
    torch.testing.assert_close(rows[0](h.chunk(2, -1)[0]), row(h), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        ColumnParallelLinear(col, 2, 2)


def _blocks_and_rest(model):
    blocks = sum(p.nbytes for n, p in model.named_parameters() if ".self_attn." in n or ".mlp." in n)
    return blocks, sum(p.nbytes for p in model.parameters()) - blocks


def test_a_tensor_parallel_rank_holds_its_share_of_the_blocks_and_the_rest_whole():
    model = lk.models.build("llama-2-7b", "tiny")
    blocks, rest = _blocks_and_rest(model)
    with fake_ranks(4):
        tensor_parallel.shard_llama(model, rank=1, world=4)
        assert sum(p.nbytes for p in model.parameters()) == blocks // 4 + rest
        ids = next(lk.data.batches(2, 16))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss      # runs; its value means nothing here
        loss.backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    with fake_ranks(3), pytest.raises(ValueError, match="must divide by the world size 3"):
        tensor_parallel.shard_llama(lk.models.build("llama-2-7b", "tiny"), rank=0, world=3)



def test_shard_llama_refuses_a_world_that_is_not_the_group_or_splits_a_head():
    model = lk.models.build("llama-2-7b", "tiny")
    with pytest.raises(ValueError, match="world must be the process group's size .no group"):
        tensor_parallel.shard_llama(model, rank=0, world=2)
    with fake_ranks(2), pytest.raises(ValueError, match="world must be the process group's size .2., got 4"):
        tensor_parallel.shard_llama(model, rank=0, world=4)
    for rank, world in ((0, 0), (2, 2), (0, "2")):
        with pytest.raises(ValueError, match="rank|world"):
            tensor_parallel.shard_llama(model, rank=rank, world=world)
    six = lk.models.build("llama-2-7b", "tiny", num_attention_heads=6, num_key_value_heads=6, hidden_size=96,
                          head_dim=16)          # q, k, v: 96 features, divisible by 4 ranks; 6 heads are not
    with fake_ranks(4), pytest.raises(ValueError, match=r"num_attention_heads \(6\) must divide by the world size 4"):
        tensor_parallel.shard_llama(six, rank=0, world=4)


def test_a_skipped_adam_step_is_refused():
    g = torch.randn(64, generator=torch.Generator().manual_seed(0))
    step = -1e-3 * g / (g.abs() + 1e-8)                  # Adam's first step, about lr * sign(g)
    assert_same_adam_step(step + 1e-9, step, g, 1e-3)
    with pytest.raises(AssertionError):
        assert_same_adam_step(torch.zeros_like(step), step, g, 1e-3)
