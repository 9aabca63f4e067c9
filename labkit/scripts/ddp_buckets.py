"""DDP's gradient buckets on N ranks (torchrun -m labkit.scripts.ddp_buckets): all-reduces counted, backward timed.

DDP all-reduces gradients in buckets of about `bucket_cap_mb` each, and starts a bucket's all-reduce as soon as
backward has produced every gradient in it, so communication overlaps the rest of backward. For each cap the
same tiny Llama (fp32) is wrapped in DDP with torch's own `allreduce_hook` registered (the Python twin of DDP's
built-in all-reduce: same division by N, same asynchronous all-reduce per bucket), so that each bucket passes
through the process group's Python methods, where `labkit.collectives.process_group_calls` counts it. DDP's first
step puts every gradient in one bucket and then rebuilds the buckets in the order the gradients arrived, so the
second step is counted, each bucket's bytes as the hook sees them. `bucket_cap_mb=None` is DDP's default: 25 MiB
buckets after a first one of 1 MiB (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, used only when the cap is left
to its default). Then REPEATS steps are timed, backward only (its all-reduces included: DDP's backward returns
when every bucket is averaged), against the same model without DDP whose gradients are flattened and all-reduced
once after backward, against backward alone and that one all-reduce alone, and against an all-reduce of 4 bytes
(what every call costs however small: the latency).
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
BATCH, SEQ, REPEATS = 2, 64, 5           # per rank


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


def median_backward(model, ids, after=None):
    timed_backward(model, ids, after)               # warm-up
    return statistics.median(timed_backward(model, ids, after) for _ in range(REPEATS))


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


def median_all_reduce(model, repeats=REPEATS):
    """The one all-reduce of every gradient, alone (the gradients already there), median of `repeats`."""
    one_all_reduce(model)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        one_all_reduce(model)
        if flat_on_gpu(model):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


def ddp_run(cap_mb, dev, ids):
    """Buckets of one DDP step after the rebuild, as the process group saw them, and backward's median time."""
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
    return dict(cap_mb=cap_mb, first_step=first, counted=dict(counts), bucket_bytes=list(sizes),
                median_s=median_backward(ddp, ids))


def main():
    dev = init()
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = next(lk.data.batches(BATCH * world, SEQ, seed=0, device=dev)).chunk(world)[rank]
    model = build(dev)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    out = dict(world=world, batch=BATCH, seq=SEQ, repeats=REPEATS, param_bytes=sizes,
               backward_alone_s=median_backward(model, ids))
    loss_of(model, ids).backward()
    with process_group_calls() as counts:
        one_all_reduce(model)
    out["one_all_reduce_counted"] = dict(counts)
    out["all_reduce_alone_s"] = median_all_reduce(model)
    out["all_reduce_latency_s"] = median_latency(dev)
    out["first_bucket_default_bytes"] = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20)   # torch's constant
    model.zero_grad(set_to_none=True)
    out["after_backward_s"] = median_backward(model, ids, functools.partial(one_all_reduce, model))
    progress(f"backward alone, the all-reduce alone, and one after the other: {REPEATS} times each, timed")
    out["ddp"] = []
    for cap in CAPS_MB:
        out["ddp"].append(ddp_run(cap, dev, ids))
        progress(f"DDP with bucket_cap_mb={cap}{' (the default)' if cap is None else ''}: buckets counted, backward timed")
    if rank == 0:
        write_result(out)
    finish()


if __name__ == "__main__":
    main()
