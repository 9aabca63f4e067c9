"""ZeRO stages 0 (DDP) to 3 from scratch on N ranks (torchrun -m labkit.scripts.zero_scratch [--quick]).

Part 1, correctness: every rank builds the same fp32 model (same seed) and, alone, the single-process
reference: AdamW on the whole batch. Each stage then trains a fresh copy for STEPS steps, each rank on
its 1/N of the batch; the losses (averaged over ranks) of every step and of the model after the last one
(on the first batch again), and the weights after the last step, must equal the reference's. Part 2, memory and communication (skipped with --quick): the same stages with
mixed-precision Adam (bf16 weights and gradients, fp32 master weights and moments); the second step is
followed by `lk.track` on every rank, which labels what the engine holds by category, and the bytes of
every collective are counted. --quick: a small MLP instead of the tiny Llama (what tests/test_zero.py runs).
"""
import sys

import torch
import torch.distributed as dist

import labkit as lk
from labkit import zero
from labkit.collectives import process_group_calls
from labkit.launch import finish, init, progress, write_result

GLOBAL_BATCH, SEQ, STEPS, LR = 4, 64, 3, 1e-3
# fp32 on both sides; only the order of the sums differs (each rank sums half the batch, then the
# ranks' halves are added), about 1e-7 relative on the gradients. Adam's first step moves a weight by
# lr * g / (|g| + eps), eps = 1e-8: a last-bit difference in g matters only where it flips g's sign, at
# gradients within rounding of zero, and the two runs' steps then differ by 2 lr |g| / (|g| + eps), at most
# lr while |g| <= eps. So weights are held to atol = lr (the printed errors stay far below it); what catches
# a wrong or skipped step is the losses, which every step changes, held to 1e-5.
LOSS_TOL, PARAM_TOL = 1e-5, dict(rtol=1e-4, atol=LR)
DEVICE = [torch.device("cpu")]          # this rank's device, set by main() (NCCL ranks each have a GPU)


def llama(dtype, device="cpu"):
    model = lk.models.build("llama-2-7b", "tiny", dtype=dtype, seed=0, device=device)
    inner = model.model
    units = [inner.embed_tokens, *inner.layers, inner.norm, model.lm_head]   # ZeRO-3 gathers one at a time
    return model, units


def mlp(dtype, device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 7)).to(device, dtype)
    return model, list(model.children())


def batches(quick, device="cpu"):
    if quick:
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(GLOBAL_BATCH, 16, generator=g).to(device), torch.randn(GLOBAL_BATCH, 7, generator=g).to(device))
                for _ in range(STEPS)]
    return [(ids, ids) for ids in lk.data.batches(GLOBAL_BATCH, SEQ, steps=STEPS, seed=0, device=device)]


def loss_of(model, x, y, quick):
    if quick:
        return torch.nn.functional.mse_loss(model(x), y)
    return model(input_ids=x, labels=y, use_cache=False).loss


def mean_over_ranks(value):
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE[0])
    dist.all_reduce(t)                                      # not counted: only for the report
    return t.item() / dist.get_world_size()


def full_weights(engine):
    """Every weight, whole, on every rank (stage 3 gathers the shards)."""
    if engine.stage < 3:
        return [p.detach().clone() for p in engine.params]
    out = []
    for i, local in enumerate(engine.local):
        parts = [torch.empty_like(local) for _ in range(engine.world)]
        dist.all_gather(parts, local.detach())
        out.append(zero.unshard(parts, engine.shape[i]))
    return out


def reference(build, data, quick):
    model, _ = build(torch.float32, DEVICE[0])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for x, y in data:
        loss = loss_of(model, x, y, quick)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():                                   # the last step's effect: the loss once more
        losses.append(loss_of(model, *data[0], quick).item())
    return losses, [p.detach() for p in model.parameters()]


def check_stage(stage, build, data, ref_losses, ref_params, quick):
    rank, world = dist.get_rank(), dist.get_world_size()
    model, units = build(torch.float32, DEVICE[0])
    engine = zero.engine(model, stage, units, lr=LR)
    losses = []
    for x, y in data:
        loss = loss_of(model, x.chunk(world)[rank], y.chunk(world)[rank], quick)
        loss.backward()
        engine.step()
        losses.append(mean_over_ranks(loss.item()))
    x, y = data[0]
    with torch.no_grad():                                   # after the last step: a skipped or wrong one shows here
        losses.append(mean_over_ranks(loss_of(model, x.chunk(world)[rank], y.chunk(world)[rank], quick).item()))
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst < LOSS_TOL, (stage, losses, ref_losses)
    errors = []
    for w, w_ref in zip(full_weights(engine), ref_params):
        torch.testing.assert_close(w, w_ref, **PARAM_TOL)
        errors.append((w - w_ref).abs().max().item())
    return dict(stage=stage, losses=losses, loss_error=worst, max_weight_error=max(errors))


def measure_stage(stage, build, data, quick):
    """Mixed precision: two steps, the second tracked; what each rank holds by category, and its bytes sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, units = build(torch.bfloat16, DEVICE[0])
    params = sum(p.numel() for p in model.parameters())
    padded = sum(zero.shard_size(p.numel(), world) * world for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel() if not quick else 0
    engine = zero.engine(model, stage, units, lr=LR)
    for step, (x, y) in enumerate(data[:2]):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if quick:                                          # the MLP's inputs in the weights' dtype
            x, y = x.bfloat16(), y.bfloat16()
        if step == 0:
            loss_of(model, x, y, quick).backward()
            engine.step()
            continue
        dist.barrier()
        zero.reset_comm()
        with lk.track(model, engine.states()) as mem, process_group_calls() as pg:   # held; sent, as gloo sees it
            engine.watch(mem)                              # ... under its category, also what it makes
            loss = loss_of(model, x, y, quick)
            mem.mark("backward")
            loss.backward()
            del loss
            mem.mark("after backward")
            engine.step()
        engine.watch(None)
    out = dict(stage=stage, rank=rank, params=params, padded_params=padded, embed_params=embed, tensors=len(engine.numel),
               at_rest=mem.at("after backward"), peak=mem.peak, peak_parts=mem.peak_parts, max_parts=mem.max_parts,
               comm=dict(zero.COMM), volume=zero.comm_volume(),
               pg_comm=dict(pg), pg_volume=2 * pg["all_reduce"] + pg["reduce_scatter"] + pg["all_gather"])
    if stage == 3 and rank == 0:                           # the timeline from the block's start, with its all-gathers
        tl, start = mem.timeline, next(i for i, t in mem.marks if t == "start")
        out["timeline"] = {k: tl[k][start:].tolist() for k in ("parameters", "total")}
        out["marks"] = [(i - start, t) for i, t in mem.marks if t in ("backward", "after backward", "all-gather",
                                                                      "all-gather (backward)", "forward end")]
    return out


def main():
    quick = "--quick" in sys.argv[1:]
    DEVICE[0] = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    build = mlp if quick else llama
    data = batches(quick, DEVICE[0])
    ref_losses, ref_params = reference(build, data, quick)
    checks = []
    for stage in zero.STAGES:
        checks.append(check_stage(stage, build, data, ref_losses, ref_params, quick))
        progress(f"ZeRO stage {stage}, {world} ranks: losses and weights after {STEPS} steps match one process")
    result = dict(world=world, steps=STEPS, global_batch=GLOBAL_BATCH, seq=SEQ, lr=LR, reference_losses=ref_losses,
                  checks=checks, loss_tol=LOSS_TOL, param_tol=PARAM_TOL)
    runs = []
    for stage in zero.STAGES:
        runs.append(measure_stage(stage, build, data, quick))
        progress(f"ZeRO stage {stage}, {world} ranks: mixed-precision step tracked")
    gathered = [None] * world
    dist.gather_object(runs, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        result["runs"] = [r for per_rank in gathered for r in per_rank]
        write_result(result)
    finish()


if __name__ == "__main__":
    main()
