"""DDP's gradient buckets on N ranks (torchrun -m labkit.scripts.ddp_buckets): all-reduces counted, backward timed.

DDP all-reduces gradients in buckets of about `bucket_cap_mb` each, and starts a bucket's all-reduce as soon as
backward has produced every gradient in it, so communication overlaps the rest of backward. For each cap the
same tiny Llama (fp32) is wrapped in DDP with torch's own `allreduce_hook` registered (the Python twin of DDP's
built-in all-reduce: same division by N, same asynchronous all-reduce per bucket), so that each bucket passes
through the process group's Python methods, where `labkit.collectives.process_group_calls` counts it. DDP's first
step puts every gradient in one bucket and then rebuilds the buckets in the order the gradients arrived, so the
second step is counted, each bucket's bytes as the hook sees them. `bucket_cap_mb=None` is DDP's default: 25 MiB
buckets after a first one of 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, used only when the cap is left
to its default). Then REPEATS steps are timed (3 at tiny size, 5 at full), backward only (its all-reduces
included: DDP's backward returns when every bucket is averaged), against the same model without DDP whose
gradients are flattened and all-reduced once after backward, against backward alone and that one all-reduce
alone, and against an all-reduce of 4 bytes (what every call costs however small: the latency). Times compared
with each other are measured in turn in one loop (each DDP run beside backward alone), so that a shared
machine's load changes them alike.
"""
import functools
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import labkit as lk
from labkit.collectives import process_group_calls
from labkit.launch import finish, init, progress, write_result

CAPS_MB = (0.25, 1, 4, None)             # None: DDP's default (1 MiB first, then 25 MiB); the tiny Llama's gradients: 7.25 MiB
BATCH, SEQ = 2, 64                       # per rank
REPEATS = 3 if lk.size() == "tiny" else 5   # timed steps per median (tiny: CI's size, fewer rounds)


def build(dev):
    return lk.models.build("llama-2-7b", "tiny", seed=0, device=dev)


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def timed_backward(model, ids, after=None):
    """Seconds from the start of backward until every gradient is averaged: the forward runs untimed first."""
    loss = loss_of(model, ids)
    if loss.is_cuda:
        torch.cuda.synchronize()                    # the forward's kernels finish before the clock starts
    dist.barrier()                                  # both ranks start backward together
    t0 = time.perf_counter()
    loss.backward()
    if after is not None:
        after()
    if loss.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def one_all_reduce(model):
    """Every gradient flattened into one buffer, all-reduced once after backward, averaged, copied back."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def flat_on_gpu(model):
    return next(model.parameters()).is_cuda


def timed_all_reduce(model):
    """Seconds of the one all-reduce of every gradient, alone (the gradients already there)."""
    dist.barrier()
    t0 = time.perf_counter()
    one_all_reduce(model)
    if flat_on_gpu(model):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved_times(model, ids):
    """Medians of backward alone, the one all-reduce alone, and backward then that all-reduce, measured in turn
    in one loop: on a shared machine, times taken seconds apart are not comparable, times taken in turn are."""
    after = functools.partial(one_all_reduce, model)
    timed_backward(model, ids), timed_backward(model, ids, after)       # warm-up
    alone, reduce, both = [], [], []
    for _ in range(REPEATS):
        alone.append(timed_backward(model, ids))
        loss_of(model, ids).backward()
        reduce.append(timed_all_reduce(model))
        model.zero_grad(set_to_none=True)
        both.append(timed_backward(model, ids, after))
    return statistics.median(alone), statistics.median(reduce), statistics.median(both)


def median_latency(dev, repeats=4 * REPEATS):
    """Seconds of an all-reduce of one fp32 number: what every call pays whatever its size."""
    t = torch.zeros(1, device=dev)
    dist.all_reduce(t)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if t.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sized_hook(sizes, bucket):
    """torch's allreduce_hook on the default process group, noting the bytes of each bucket it is handed
    (DDP passes the hook's state, here the list `sizes`, first)."""
    sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
    return allreduce_hook(None, bucket)


def ddp_run(cap_mb, dev, ids, model):
    """Buckets of one DDP step after the rebuild, as the process group saw them, and backward's median time,
    with and without DDP (`model`, the same weights unwrapped), measured in turn."""
    ddp = DDP(build(dev), bucket_cap_mb=cap_mb)       # None: DDP's default
    sizes = []
    ddp.register_comm_hook(sizes, sized_hook)
    first = {}
    for step in range(2):
        sizes.clear()
        with process_group_calls() as counts:
            loss_of(ddp, ids).backward()
        ddp.zero_grad(set_to_none=True)
        first = first or dict(counts)
    counted = dict(cap_mb=cap_mb, first_step=first, counted=dict(counts), bucket_bytes=list(sizes))   # before the timing
    timed_backward(ddp, ids), timed_backward(model, ids)                 # warm-up
    with_ddp, alone = [], []
    for _ in range(REPEATS):
        with_ddp.append(timed_backward(ddp, ids))
        alone.append(timed_backward(model, ids))
    return dict(counted, median_s=statistics.median(with_ddp), backward_alone_s=statistics.median(alone))


def main():
    dev = init()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = next(lk.data.batches(BATCH * world, SEQ, seed=0, device=dev)).chunk(world)[rank]
    model = build(dev)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    out = dict(world=world, batch=BATCH, seq=SEQ, repeats=REPEATS, param_bytes=sizes)
    loss_of(model, ids).backward()
    with process_group_calls() as counts:
        one_all_reduce(model)
    out["one_all_reduce_counted"] = dict(counts)
    model.zero_grad(set_to_none=True)
    out["backward_alone_s"], out["all_reduce_alone_s"], out["after_backward_s"] = interleaved_times(model, ids)
    out["all_reduce_latency_s"] = median_latency(dev)
    out["first_bucket_default_bytes"] = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20)   # torch's constant
    progress(f"backward alone, the all-reduce alone, and one after the other: {REPEATS} times each, in turn, timed")
    out["ddp"] = []
    for cap in CAPS_MB:
        out["ddp"].append(ddp_run(cap, dev, ids, model))
        progress(f"DDP with bucket_cap_mb={cap}{' (the default)' if cap is None else ''}: buckets counted, backward timed")
    if rank == 0:
        write_result(out)
    finish()


if __name__ == "__main__":
    main()
