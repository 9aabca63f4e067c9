"""Pipeline parallelism on N ranks (torchrun -m labkit.scripts.pipeline_parallel): GPipe and 1F1B.

A tiny Llama is split into one stage per rank (the embedding on the first, the norm and LM head on the
last), the layers cut so that every stage does about the same forward FLOPs: the LM head weighs about
two decoder layers here, so the last stage gets fewer layers. Rank 0 first counts each block's forward
and backward FLOPs (FlopCounterMode). For each schedule and number of micro-batches m, every rank runs
a warm-up step and then a recorded step with the same stage and schedule objects, logging when its
stage ran each forward and backward chunk, in the order the schedule chose (on a GPU, CUDA events on the
stream the chunks run on: the host's clock would time kernel launches), and its peak memory; the last rank
checks the loss against the unsplit model.
"""
import functools
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.flop_counter import FlopCounterMode

import labkit as lk
from labkit.launch import finish, init, progress, write_result
from labkit.pipeline_parallel import Stage, balanced_split, loss_fn

BATCH, SEQ = 16, 64
MICROBATCHES = (2, 4, 8)


def flops(fn):
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def block_flops(model, ids):
    """Forward and backward FLOPs of one sequence through each decoder layer and through norm + head + loss.

    FlopCounterMode has no formula for the CPU flash-attention kernel: on a CPU the attention scores'
    4·T²·h FLOPs per layer are left out (a few percent of a layer at T = 64); on a GPU they count."""
    h = model.model.embed_tokens(ids).detach().requires_grad_()        # (1, T, h)
    pe = model.model.rotary_emb(h, torch.arange(ids.shape[1], device=ids.device)[None])

    def decoder_layer(layer, x):
        return layer(x, position_embeddings=pe, attention_mask=None)

    def head_and_loss(x):
        return loss_fn(model.lm_head(model.model.norm(x)), ids)

    blocks = [functools.partial(decoder_layer, layer) for layer in model.model.layers] + [head_and_loss]
    out = []
    for block in blocks:
        outputs = []

        def forward():
            outputs.append(block(h))

        def backward():
            outputs[0].backward(torch.ones_like(outputs[0]))

        out.append({"F": flops(forward), "B": flops(backward)})
    model.zero_grad(set_to_none=True)
    return out                                                       # the embedding: a lookup, 0 FLOPs


class Clock:
    """Timestamps of work on `dev`: the host's clock on a CPU; on a GPU, CUDA events recorded on the stream the
    chunks run on (a kernel launch returns at once, so the host's clock would time the launches), read as
    seconds after `synchronize()`."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, stamps, origin):
        """`stamps` as seconds since `origin` (all taken by `now`)."""
        if not self.cuda:
            return [t - origin for t in stamps]
        torch.cuda.synchronize()
        return [origin.elapsed_time(t) / 1e3 for t in stamps]


def timed(stage, events, clock):
    """Record (kind, chunk, start, end) of each forward and backward chunk this stage runs."""
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        original = getattr(stage, name)
        def wrapper(chunk, *args, _original=original, _kind=kind, **kwargs):
            t0 = clock.now()
            out = _original(chunk, *args, **kwargs)
            events.append((_kind, chunk, t0, clock.now()))
            return out
        setattr(stage, name, wrapper)


def run_schedule(cls, m, module, ids, rank, world, dev):
    """One warm-up step, then one recorded step, with the same stage and schedule: what training does."""
    stage = PipelineStage(module, rank, world, dev)
    schedule = cls(stage, n_microbatches=m, loss_fn=loss_fn)
    events, clock = [], Clock(dev)
    timed(stage, events, clock)
    for step in ("warm-up", "recorded"):
        events.clear()
        losses = []
        module.zero_grad(set_to_none=True)
        if clock.cuda:
            torch.cuda.synchronize()
        dist.barrier()                                  # every rank starts the step together
        with lk.track(module) as mem:
            t0 = clock.now()
            if rank == 0:
                schedule.step(ids)
            elif rank == world - 1:
                schedule.step(target=ids, losses=losses)
            else:
                schedule.step()
            t1 = clock.now()
    starts = clock.seconds([s for _, _, s, _ in events], t0)
    ends, (total,) = clock.seconds([e for *_, e in events], t0), clock.seconds([t1], t0)
    return dict(schedule=cls.__name__.removeprefix("Schedule"), m=m, rank=rank, total=total,
                busy=sum(e - s for s, e in zip(starts, ends)),
                events=[(k, c, s, e) for (k, c, *_), s, e in zip(events, starts, ends)],
                peak=mem.peak, peak_activations=mem.max_parts["activations"],
                loss=torch.stack(losses).mean().item() if losses else None)


def main():
    dev = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = lk.models.build("llama-2-7b", "tiny", seed=0, num_hidden_layers=2 * world, device=dev)
    ids = next(lk.data.batches(BATCH, SEQ, seed=0, device=dev))
    reference = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    blocks = block_flops(model, ids[:1])
    costs = [b["F"] for b in blocks[:-1]]
    costs[-1] += blocks[-1]["F"]                        # the head sits with the last layer
    split = balanced_split(costs, world)
    lo, hi = split[rank]
    module = Stage(model, lo, hi, rank == 0, rank == world - 1)
    runs = []
    for cls in (ScheduleGPipe, Schedule1F1B):
        for m in MICROBATCHES:
            r = run_schedule(cls, m, module, ids, rank, world, dev)
            if rank == world - 1:
                assert abs(r["loss"] - reference) < 1e-5, (r["schedule"], m, r["loss"], reference)
            runs.append(r)
            progress(f"pipeline, {world} stages: {r['schedule']} with {m} micro-batches recorded")
    gathered = [None] * world
    dist.gather_object(runs, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        write_result(dict(world=world, microbatches=list(MICROBATCHES), reference_loss=reference,
                          block_flops=blocks, split=split, runs=[r for per_rank in gathered for r in per_rank]))
    finish()


if __name__ == "__main__":
    main()
