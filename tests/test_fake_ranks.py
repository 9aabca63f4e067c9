"""One rank of a layout, measured alone: `labkit.launch.fake_ranks` (PyTorch's fake process group), the layers
of `labkit.tensor_parallel.shard_llama` and `labkit.zero`'s ZeRO-3 on it, on real and on FakeTensorMode tensors."""
import pytest
import torch
import torch.distributed as dist

import labkit as lk
from labkit import tensor_parallel
from labkit import zero
from labkit.launch import fake_ranks
from labkit.scripts.tensor_parallel import assert_same_adam_step


def test_fake_ranks_makes_this_process_one_rank_and_then_leaves():
    with fake_ranks(8, rank=3):
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (3, 8, "fake")
        t = torch.ones(4)
        dist.all_reduce(t)                              # returns at once; nothing is sent anywhere
        with pytest.raises(RuntimeError, match="already running here"):
            with fake_ranks(2):
                pass
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, message", [(dict(world=0), "world must be .*, got 0"),
                                             (dict(world=2, rank=2), r"rank must be an int in \[0, 2\), got 2"),
                                             (dict(world=True), "world must be .*, got True")])
def test_fake_ranks_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        with fake_ranks(**kwargs):
            pass
    assert not dist.is_initialized()


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


def _zero3_step(device):
    """Peak and parts of rank 0 of 2 under ZeRO-3, the second mixed-precision step of the tiny Llama."""
    with fake_ranks(2):
        model = lk.models.build("llama-2-7b", "tiny", dtype=torch.bfloat16, device=device)
        ids = next(lk.data.batches(2, 32))                 # real token ids: fake tensors cannot be sampled
        with model.fake_mode if device == "fake" else _nothing():
            units = [model.model.embed_tokens, *model.model.layers, model.model.norm, model.lm_head]
            engine = zero.Zero3(model, units=units, lr=1e-3)
            for _ in range(2):
                zero.reset_comm()
                with lk.track(model, engine.states()) as mem:
                    engine.watch(mem)
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    engine.step()
                engine.watch(None)
    return mem, dict(zero.COMM)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_zero3_measures_the_same_on_fake_tensors_as_on_real_ones():
    """Fake tensors all report data_ptr() 0: ZeRO-3's saved-tensor hook tells a gathered weight by its storage,
    so on fake tensors it still replaces only gathered weights (activations stay, weights are gathered again)."""
    (real, real_comm), (fake, fake_comm) = _zero3_step("cpu"), _zero3_step("fake")
    assert fake.peak == real.peak and fake.peak_parts == real.peak_parts
    # a kernel's scratch may differ between the CPU kernel and its fake (meta) version: 1% of the activations
    assert abs(fake.max_parts["activations"] - real.max_parts["activations"]) < 0.01 * real.max_parts["activations"]
    assert fake_comm == real_comm and real_comm["all_gather_backward"] > 0


def test_a_skipped_adam_step_is_refused():
    g = torch.randn(64, generator=torch.Generator().manual_seed(0))
    step = -1e-3 * g / (g.abs() + 1e-8)                  # Adam's first step, about lr * sign(g)
    assert_same_adam_step(step + 1e-9, step, g, 1e-3)
    with pytest.raises(AssertionError):
        assert_same_adam_step(torch.zeros_like(step), step, g, 1e-3)
