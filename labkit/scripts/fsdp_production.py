"""The production versions of ZeRO on N ranks (torchrun -m labkit.scripts.fsdp_production).

Same model, batches and single-process reference as labkit.scripts.zero_scratch:
  ZeroRedundancyOptimizer + DDP   ZeRO-1: each rank keeps the Adam state of its share of the parameters
                                  (whole tensors, balanced greedily), DDP all-reduces the gradients
  FSDP2 (fully_shard)             ZeRO-3: each decoder layer, then the root, sharded on dim 0 as DTensors
  + MixedPrecisionPolicy          bf16 compute weights gathered from fp32 shards (the master copy),
                                  gradients reduced in fp32
  + CPUOffloadPolicy              shards, gradients and the optimizer step on the CPU (on a CPU-only run
                                  they are there already: it must only give the same result)
Each is checked against the reference (the losses of every step and after the last, and the weights); what each rank holds is
counted from its local tensors (`DTensor.to_local()`), and the step's peak measured with
lk.track(backend="profiler"), which sees real allocations (DTensor's inner ops run below a dispatch mode).
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import labkit as lk
from labkit.launch import finish, init, progress, write_result
from labkit.scripts import zero_scratch
from labkit.scripts.zero_scratch import LR, PARAM_TOL, LOSS_TOL, batches, loss_of, mean_over_ranks, reference

BF16_LOSS_TOL = 2e-2        # bf16 weights and activations: about 3 significant digits; relative, first step


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def state_bytes(opt):
    return sum(local(v).nbytes for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def train(model, opt, data, steps, track_last=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, mem = [], None
    for step, (x, y) in enumerate(data[:steps]):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        if track_last and step == steps - 1:
            with lk.track(backend="profiler") as mem:
                loss = loss_of(model, x, y, False)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            loss = loss_of(model, x, y, False)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss.item()))
    if steps == len(data):                             # every step run: the loss once more, after the last one
        x, y = data[0]
        with torch.no_grad():
            losses.append(mean_over_ranks(loss_of(model, x.chunk(world)[rank], y.chunk(world)[rank], False).item()))
        if hasattr(model, "reshard"):                  # FSDP2 keeps the root gathered after a forward with no backward
            model.reshard()
    return losses, mem


def compare(name, losses, ref_losses, model, ref_params):
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst < LOSS_TOL, (name, losses, ref_losses)
    for p, p_ref in zip(model.parameters(), ref_params):
        torch.testing.assert_close(full(p.detach()), p_ref, **PARAM_TOL)
    return worst


def fsdp(model, mesh, **policy):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def main():
    dev = zero_scratch.DEVICE[0] = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data = batches(False, dev)
    steps = len(data)
    ref_losses, ref_params = reference(zero_scratch.llama, data, False)
    full_bytes = sum(p.nbytes for p in ref_params)
    out = dict(world=world, full_param_bytes=full_bytes, reference_losses=ref_losses)

    model, _ = zero_scratch.llama(torch.float32, dev)
    ddp = DDP(model)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, foreach=False)
    losses, _ = train(ddp, opt, data, steps)
    per_rank = [None] * world                          # its greedy split by whole tensors differs per rank
    dist.all_gather_object(per_rank, state_bytes(opt.optim))
    out["zero_redundancy"] = dict(losses=losses, loss_error=compare("ZeroRedundancyOptimizer", losses, ref_losses, model, ref_params),
                                  state_bytes=per_rank, full_state_bytes=2 * full_bytes)
    progress("ZeroRedundancyOptimizer + DDP: losses and weights match one process")

    mesh = init_device_mesh(dev.type, (world,))
    model = fsdp(zero_scratch.llama(torch.float32, dev)[0], mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, mem = train(model, opt, data, steps, track_last=True)
    out["fsdp"] = dict(losses=losses, loss_error=compare("fully_shard", losses, ref_losses, model, ref_params),
                       local_param_bytes=sum(local(p).nbytes for p in model.parameters()),
                       state_bytes=state_bytes(opt), peak=mem.peak)
    progress("FSDP2 fully_shard: losses and weights match one process")

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = fsdp(zero_scratch.llama(torch.float32, dev)[0], mesh, mp_policy=policy)
    seen = []                                          # the dtype a projection computes with

    def note_dtype(module, args, y):
        seen.append(str(module.weight.dtype))

    model.model.layers[0].self_attn.q_proj.register_forward_hook(note_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, mem = train(model, opt, data, 2, track_last=True)
    assert abs(losses[0] / ref_losses[0] - 1) < BF16_LOSS_TOL, (losses, ref_losses)
    out["fsdp_mixed"] = dict(losses=losses, loss_rel_error=abs(losses[0] / ref_losses[0] - 1),
                             local_param_bytes=sum(local(p).nbytes for p in model.parameters()),
                             param_dtype=str(next(model.parameters()).dtype), compute_dtype=seen[-1],
                             state_bytes=state_bytes(opt), peak=mem.peak)
    progress("FSDP2 with MixedPrecisionPolicy: bf16 compute, fp32 shards")

    model = fsdp(zero_scratch.llama(torch.float32, dev)[0], mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses, _ = train(model, opt, data, steps)
    devices = sorted({local(p).device.type for p in model.parameters()})
    out["fsdp_offload"] = dict(losses=losses, loss_error=compare("CPUOffloadPolicy", losses, ref_losses, model, ref_params),
                               shard_devices=devices, compute_device=dev.type)
    progress("FSDP2 with CPUOffloadPolicy: same result, shards on the CPU")
    if rank == 0:
        write_result(out)
    finish()


if __name__ == "__main__":
    main()
