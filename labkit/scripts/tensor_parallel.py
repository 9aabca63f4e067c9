"""Tensor parallelism on N ranks (torchrun -m labkit.scripts.tensor_parallel): from scratch, then DTensor.

Every rank builds the same tiny Llama (same seed). Part 1 shards layer 0's MLP and attention with
labkit.tensor_parallel and checks outputs and gradients against the unsharded blocks, counting the bytes
all-reduced and the memory per rank. Part 2 shards every layer with PyTorch's `parallelize_module`
(ColwiseParallel / RowwiseParallel) and checks the loss and the weights after one AdamW step.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import labkit as lk
from labkit.estimate import activation_bytes_per_token
from labkit.launch import finish, init, progress, write_result
from labkit.tensor_parallel import COMM, ParallelAttention, ParallelMLP

B, T = 4, 64
# fp32 sums in a different order on each rank: agreement to ~1e-6 relative, so rtol 1e-4 is generous
TOL = dict(rtol=1e-4, atol=1e-5)


def check_block(name, block, parallel, x, extra=()):
    """Outputs, input gradients and weight-gradient shards of `parallel` against `block`."""
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = block(x_ref, *extra)
    out_ref = out_ref[0] if isinstance(out_ref, tuple) else out_ref
    out_ref.pow(2).sum().backward()
    COMM.update(all_reduce_calls=0, all_reduce_bytes=0)
    with lk.track(parallel) as mem:             # what the block keeps for backward, and its output
        out = parallel(x_par, *extra)
    fwd_bytes = COMM["all_reduce_bytes"]
    x_again = x.clone().requires_grad_()
    with lk.track(block) as mem_ref:
        out_again = block(x_again, *extra)
    del out_again
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(x_par.grad, x_ref.grad, **TOL)
    return dict(forward_bytes=fwd_bytes, backward_bytes=COMM["all_reduce_bytes"] - fwd_bytes,
                calls=COMM["all_reduce_calls"], param_bytes=sum(p.nbytes for p in parallel.parameters()),
                full_param_bytes=sum(p.nbytes for p in block.parameters()),
                activations=mem.at("end")["activations"] + mem.at("end")["other"],
                full_activations=mem_ref.at("end")["activations"] + mem_ref.at("end")["other"])


class UnshardedAttention(torch.nn.Module):
    """The unsharded attention with ParallelAttention's call signature: (h, position_embeddings)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, h, pe):
        return self.attn(h, position_embeddings=pe, attention_mask=None)


def full(t):
    """A DTensor's whole value (a plain tensor as it is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_same_adam_step(step, step_ref, grad_ref, lr):
    """AdamW's first step moves a weight by lr * (g / (|g| + eps) + weight_decay * w): about lr * sign(g). Where
    the gradient is far from zero (over 1e-3 of the tensor's largest), the two runs' last-bit differences in
    g cannot change that, so the steps must agree to 1e-3 of lr: a skipped step (0) or a wrong one fails.
    Near zero, an ulp can flip the sign (a difference of up to 2 lr): those elements are left out."""
    sure = grad_ref.abs() > 1e-3 * grad_ref.abs().max()
    assert sure.any() and step_ref[sure].abs().min() > 0.5 * lr, "the reference took a step of about lr"
    torch.testing.assert_close(step[sure], step_ref[sure], rtol=1e-3, atol=1e-3 * lr)


def main():
    dev = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = lk.models.build("llama-2-7b", "tiny", seed=0, device=dev)
    cfg, layer = model.config, model.model.layers[0]
    x = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dev)
    pe = model.model.rotary_emb(x, torch.arange(T, device=dev)[None].expand(B, T))

    mlp = ParallelMLP(layer.mlp, rank, world)
    result = {"world": world, "tokens": B * T, "hidden": cfg.hidden_size, "mlp": check_block("mlp", layer.mlp, mlp, x)}

    def shard(w, dim):                          # this rank's slice of an unsharded weight's gradient
        return w.grad.chunk(world, dim)[rank]

    torch.testing.assert_close(mlp.gate.weight.grad, shard(layer.mlp.gate_proj.weight, 0), **TOL)
    torch.testing.assert_close(mlp.down.weight.grad, shard(layer.mlp.down_proj.weight, 1), **TOL)

    attn = ParallelAttention(layer.self_attn, rank, world)
    result["attention"] = check_block("attention", UnshardedAttention(layer.self_attn), attn, x, (pe,))
    torch.testing.assert_close(attn.q.weight.grad, shard(layer.self_attn.q_proj.weight, 0), **TOL)
    torch.testing.assert_close(attn.o.weight.grad, shard(layer.self_attn.o_proj.weight, 1), **TOL)
    result["estimated_activation_bytes_per_token_unsharded"] = activation_bytes_per_token(cfg, T, "fp32")
    progress(f"tensor parallel, {world} ranks: layer 0's MLP and attention match the unsharded blocks")

    # Part 2: PyTorch's own tensor parallelism on every layer, one optimizer step.
    mesh = init_device_mesh(dev.type, (world,))
    plan = {**{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    tp, ref = (lk.models.build("llama-2-7b", "tiny", seed=0, device=dev) for _ in range(2))
    for block in tp.model.layers:
        parallelize_module(block, mesh, plan)
    ids = next(lk.data.batches(2, 32, seed=0, device=dev))
    losses, opts, lr = [], [], 1e-3
    for m in (tp, ref):
        opts.append(torch.optim.AdamW(m.parameters(), lr=lr, foreach=False))
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 1e-5, losses
    for p, p_ref in zip(tp.parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.grad), p_ref.grad, **TOL)
    before = [[full(p).detach().clone() for p in m.parameters()] for m in (tp, ref)]
    for opt in opts:
        opt.step()
    local = 0
    for p, p_ref, w0, w0_ref in zip(tp.parameters(), ref.parameters(), *before):
        assert_same_adam_step(full(p) - w0, p_ref - w0_ref, p_ref.grad, lr)
        local += (p.to_local() if isinstance(p, DTensor) else p).nbytes
    with torch.no_grad():                          # the step's effect on the loss: a skipped or wrong step shows here
        after = [m(input_ids=ids, labels=ids, use_cache=False).loss.item() for m in (tp, ref)]
    assert abs(after[0] - after[1]) < 1e-5 and abs(after[1] - losses[1]) > 1e-4, (after, losses)
    result["dtensor"] = dict(loss=losses[0], reference_loss=losses[1], loss_after_step=after[0],
                             reference_loss_after_step=after[1], local_param_bytes=local,
                             full_param_bytes=sum(p.nbytes for p in ref.parameters()))
    progress("parallelize_module: loss, gradients, the AdamW step and the loss after it match")
    if rank == 0:
        write_result(result)
    finish()


if __name__ == "__main__":
    main()
