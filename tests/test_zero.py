"""ZeRO from scratch (labkit.zero): the sharding arithmetic, the sharded step on 2 gloo ranks, and ZeRO-3 measured
on one fake rank, real and fake tensors alike."""
import contextlib

import pytest
import torch

import labkit as lk
from labkit import zero
from labkit.estimate import model_states
from labkit.launch import fake_ranks, launch


@pytest.mark.parametrize("numel, world", [(1, 1), (7, 2), (8, 2), (10, 4), (5, 8), (231, 2)])
def test_shards_cover_the_tensor_once_with_zero_padding(numel, world):
    t = torch.arange(1, numel + 1, dtype=torch.float32).reshape(-1, 1) if numel > 1 else torch.ones(1)
    shards = [zero.shard(t, r, world) for r in range(world)]
    s = zero.shard_size(numel, world)
    assert all(x.shape == (s,) for x in shards) and s * world - numel < world
    assert torch.equal(zero.unshard(shards, t.shape), t)
    flat = torch.cat(shards)
    assert torch.equal(flat[numel:], torch.zeros(s * world - numel)), "the padding is zeros"
    shards[0][0] = -1
    assert t.flatten()[0] != -1, "a shard is a copy: the full tensor can be freed"


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        zero.shard(torch.ones(4), 2, 2)
    with pytest.raises(ValueError, match="world must be .*, got 0"):
        zero.shard_size(4, 0)
    with pytest.raises(TypeError, match="t must be a torch.Tensor, got list"):
        zero.shard([1, 2], 0, 1)
    with pytest.raises(ValueError, match="stage must be one of \\(0, 1, 2, 3\\), got 4"):
        zero.engine(torch.nn.Linear(2, 2), 4)
    for numel in (-5, 5.5, True):
        with pytest.raises(ValueError, match=f"numel must be an int >= 0, got {numel}"):
            zero.shard_size(numel, 2)
    with pytest.raises(ValueError, match=r"shape\[0\] must be an int >= 0, got -1"):
        zero.unshard([torch.arange(2), torch.arange(2, 4)], (-1,))
    with pytest.raises(RuntimeError, match="needs a process group"):
        zero.DDP(torch.nn.Linear(2, 2))


def test_comm_volume_counts_an_all_reduce_twice():
    zero.reset_comm()
    zero.COMM.update(all_reduce=10, reduce_scatter=3, all_gather=5, all_gather_backward=2)
    assert zero.comm_volume() == 2 * 10 + 3 + 5 + 2
    zero.reset_comm()
    assert zero.comm_volume() == 0


def test_sharded_steps_on_two_gloo_ranks_match_one_process():
    """Every stage trains 3 steps on 2 ranks (the script asserts losses and weights against one process),
    then one mixed-precision step per stage is tracked: bytes held per category and bytes communicated."""
    r = launch("labkit.scripts.zero_scratch", nproc=2, args=["--quick"], timeout=300)
    assert [c["stage"] for c in r["checks"]] == list(zero.STAGES)
    assert all(c["loss_error"] < r["loss_tol"] for c in r["checks"])
    n = r["world"]
    for run in r["runs"]:
        stage, P, padded = run["stage"], run["params"], run["padded_params"]
        held = run["at_rest"]
        want = model_states(P, dp=n, zero=stage)                       # bf16 weights and grads, fp32 Adam
        exact = {"parameters": 2 * (P if stage < 3 else padded // n),
                 "gradients": 2 * (P if stage < 2 else padded // n),
                 "optimizer": 12 * (P if stage == 0 else padded // n) + 4 * 4}   # + AdamW's step count per tensor
        assert {k: held[k] for k in exact} == exact, (stage, held, exact)
        assert abs(sum(exact.values()) / sum(want.values()) - 1) < 0.02, "padding and step counts are small"
        volume = {0: 2 * 2 * P, 1: 2 * 2 * padded, 2: 2 * 2 * padded,
                  # ZeRO-3 gathers again in backward only what backward reads: the second Linear's weight
                  # (the first's input needs no gradient), padded to 232 elements
                  3: 2 * 2 * padded + 2 * zero.shard_size(33 * 7, n) * n}[stage]
        assert run["volume"] == volume, (stage, run["comm"])


@pytest.fixture
def one_rank():
    """A process group of one (gloo, in this process): the engine's code paths without torchrun."""
    import torch.distributed as dist
    from labkit.launch import _free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


@pytest.mark.parametrize("stage", zero.STAGES)
def test_one_rank_steps_like_adamw(one_rank, stage):
    model, ref = mlp(), mlp()
    engine = zero.engine(model, stage, [model[0], model[2]], lr=1e-2)
    assert type(engine) is zero.STAGES[stage]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(x).square().mean().backward()
        engine.step()
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    weights = [zero.unshard([t.detach()], s) for t, s in zip(engine.local, engine.shape)] if stage == 3 else engine.params
    for w, w_ref in zip(weights, ref.parameters()):
        torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-6)     # one rank: the same sums, same order


def test_engine_errors_say_what_is_wrong(one_rank):
    model = mlp()
    with pytest.raises(ValueError, match="units must cover every parameter; not in any unit: \\['2.weight'"):
        zero.Zero3(model, units=[model[0]])
    with pytest.raises(ValueError, match="parameter weight of Linear is in two units"):
        zero.Zero3(model, units=[model, model[0]])
    with pytest.raises(RuntimeError, match="parameter 0.weight has no gradient: call backward\\(\\) before step\\(\\)"):
        zero.Zero1(mlp()).step()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got NoneType"):
        zero.engine(None, 1)
    with pytest.raises(ValueError, match="model must have parameters, all of them trained .*, got none"):
        zero.DDP(torch.nn.ReLU())
    frozen = mlp().requires_grad_(False)
    for stage in range(4):
        with pytest.raises(ValueError, match="got 4 frozen: 0.weight, 0.bias, 2.weight"):
            zero.engine(frozen, stage)
    with pytest.raises(TypeError, match="tracker must be what lk.track.. gives .or None., got int 5"):
        zero.DDP(mlp()).watch(5)


@pytest.mark.parametrize("torch_names", ["2.13: *_single", "2.11: all_gather_into_tensor, reduce_scatter_tensor"])
def test_the_collectives_run_on_both_torch_versions_and_warn_on_neither(one_rank, monkeypatch, torch_names):
    """torch 2.13 added all_gather_single / reduce_scatter_single and deprecates the old names (a FutureWarning
    on every call); torch 2.11, the GPU image's, has only the old ones. Without the new names the old ones run
    (here, on a torch that has both, their deprecation warning is expected); with them, nothing warns."""
    import warnings
    import torch.distributed as dist
    if torch_names.startswith("2.11"):
        monkeypatch.delattr(dist, "all_gather_single", raising=False)
        monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    model, ref = mlp(), mlp()
    engine = zero.Zero3(model, units=[model[0], model[2]], lr=1e-2)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if torch_names.startswith("2.11") else "error", FutureWarning)
        model(x).square().mean().backward()
        engine.step()
    ref(x).square().mean().backward()
    opt.step()
    for t, s, w_ref in zip(engine.local, engine.shape, ref.parameters()):
        torch.testing.assert_close(zero.unshard([t.detach()], s), w_ref, rtol=0, atol=1e-6)


def _zero3_step(device):
    """Peak and parts of rank 0 of 2 under ZeRO-3, the second mixed-precision step of the tiny Llama."""
    with fake_ranks(2):
        model = lk.models.build("llama-2-7b", "tiny", dtype=torch.bfloat16, device=device)
        ids = next(lk.data.batches(2, 32))                 # real token ids: fake tensors cannot be sampled
        with model.fake_mode if device == "fake" else contextlib.nullcontext():
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


def test_zero3_measures_the_same_on_fake_tensors_as_on_real_ones():
    """Fake tensors all report data_ptr() 0: ZeRO-3's saved-tensor hook tells a gathered weight by its storage,
    so on fake tensors it still replaces only gathered weights (activations stay, weights are gathered again)."""
    (real, real_comm), (fake, fake_comm) = _zero3_step("cpu"), _zero3_step("fake")
    assert fake.peak == real.peak and fake.peak_parts == real.peak_parts
    # a kernel's scratch may differ between the CPU kernel and its fake (meta) version: 1% of the activations
    assert abs(fake.max_parts["activations"] - real.max_parts["activations"]) < 0.01 * real.max_parts["activations"]
    assert fake_comm == real_comm and real_comm["all_gather_backward"] > 0
