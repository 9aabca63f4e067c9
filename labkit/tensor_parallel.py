"""Tensor parallelism from scratch (Megatron-LM, Shoeybi et al. 2019, sec. 3), the bytes it all-reduces counted.

Column-parallel linear:  Y = X W^T with W split along its output dimension: rank i computes Y_i = X W_i^T.
Row-parallel linear:     W split along its input dimension: rank i computes X_i W_i^T, and the sum over
                         ranks (an all-reduce) is Y.
An MLP is column-parallel then row-parallel, so the pieces never need gathering in between:
    f = copy to the ranks   (forward: identity,   backward: all-reduce the input gradient)
    g = reduce from ranks   (forward: all-reduce, backward: identity)
one all-reduce in forward and one in backward per block. `COMM` counts the bytes each rank all-reduces.
The ranks import this module from scripts started by `torchrun` (`labkit.launch`); `labkit.launch.fake_ranks`
runs one rank alone on a fake process group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checks import count, index

__all__ = ["COMM", "CopyToParallel", "ReduceFromParallel", "copy_to_parallel", "reduce_from_parallel",
           "counted_all_reduce", "shard_weight", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP",
           "ParallelAttention", "ParallelLlamaAttention", "shard_llama"]

COMM = {"all_reduce_calls": 0, "all_reduce_bytes": 0}


def counted_all_reduce(x):
    """dist.all_reduce(x) in place, its call and bytes added to COMM."""
    COMM["all_reduce_calls"] += 1
    COMM["all_reduce_bytes"] += x.nbytes
    dist.all_reduce(x)
    return x


class CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the gradient in backward (before a column-parallel layer)."""
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return counted_all_reduce(grad.contiguous())


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward (after a row-parallel layer)."""
    @staticmethod
    def forward(ctx, x):
        return counted_all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_parallel(x):
    """f: identity forward, all-reduce of the gradient backward."""
    return CopyToParallel.apply(x)


def reduce_from_parallel(x):
    """g: all-reduce forward, identity backward."""
    return ReduceFromParallel.apply(x)


def shard_weight(weight, dim, rank, world):
    """Rank `rank`'s 1/world slice of `weight` along `dim`, a new Parameter (a copy)."""
    world = count("world", world)
    rank = index("rank", rank, world)
    if weight.shape[dim] % world:
        raise ValueError(f"dimension {dim} of the weight ({weight.shape[dim]}) must divide by the world size {world}")
    return torch.nn.Parameter(weight.detach().chunk(world, dim)[rank].clone())


class ColumnParallelLinear(torch.nn.Module):
    """This rank's rows of `linear.weight` (its output features): Y_i = X W_i^T + b_i. A bias (Qwen2's q, k,
    v have one; Llama's have none) is split the same way: b_i is this rank's slice of the output features."""

    def __init__(self, linear, rank, world):
        super().__init__()
        self.weight = shard_weight(linear.weight, 0, rank, world)
        self.bias = None if linear.bias is None else shard_weight(linear.bias, 0, rank, world)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """This rank's columns of `linear.weight` (its input features); the partial products are all-reduced:
    Y = sum_i X_i W_i^T + b. A bias is whole on every rank and added once, after the all-reduce."""

    def __init__(self, linear, rank, world):
        super().__init__()
        self.weight = shard_weight(linear.weight, 1, rank, world)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone())

    def forward(self, x_i):
        y = reduce_from_parallel(F.linear(x_i, self.weight))
        return y if self.bias is None else y + self.bias


class ParallelMLP(torch.nn.Module):
    """A Llama SwiGLU MLP split over ranks: gate and up column-parallel, down row-parallel."""

    def __init__(self, mlp, rank, world):
        super().__init__()
        self.gate = ColumnParallelLinear(mlp.gate_proj, rank, world)
        self.up = ColumnParallelLinear(mlp.up_proj, rank, world)
        self.down = RowParallelLinear(mlp.down_proj, rank, world)

    def forward(self, x):                                   # (B, T, h) -> (B, T, h)
        x = copy_to_parallel(x)
        return self.down(F.silu(self.gate(x)) * self.up(x))    # (B, T, i/world) in between


class ParallelAttention(torch.nn.Module):
    """A Llama attention block split by heads: q, k, v column-parallel, o row-parallel."""

    def __init__(self, attn, rank, world):
        super().__init__()
        cfg = attn.config
        world = count("world", world)
        for name in ("num_attention_heads", "num_key_value_heads"):     # whole heads on every rank
            if getattr(cfg, name) % world:
                raise ValueError(f"{name} ({getattr(cfg, name)}) must divide by the world size {world}")
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads // world
        self.kv_heads = cfg.num_key_value_heads // world
        self.q, self.k, self.v = (ColumnParallelLinear(p, rank, world) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.o = RowParallelLinear(attn.o_proj, rank, world)

    def forward(self, x, position_embeddings):          # x: (B, T, h); cos, sin: (B, T, d)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        B, T, _ = x.shape
        x = copy_to_parallel(x)
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)       # (B, heads/world, T, d)
        k = self.k(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class ParallelLlamaAttention(ParallelAttention):
    """ParallelAttention called the way transformers' LlamaDecoderLayer calls its attention: by keyword, with
    the mask and cache arguments (ignored: causal, no cache, no padding), returning (output, no weights)."""

    def forward(self, hidden_states, position_embeddings, **ignored):
        return super().forward(hidden_states, position_embeddings), None


def shard_llama(model, rank, world):
    """Rank `rank`'s share of a transformers Llama under `world`-way tensor parallelism, in place: every decoder
    layer's attention and MLP replaced by ParallelLlamaAttention and ParallelMLP (1/world of their weights each,
    copied from the full ones, which are then dropped); the embedding, the norms and the LM head stay whole on
    every rank (Megatron-LM also splits the embedding and the head by vocabulary; this lesson does not).
    Needs a process group of `world` ranks (labkit.launch.init, or fake_ranks to measure one rank alone)."""
    world = count("world", world)
    rank = index("rank", rank, world)
    group = dist.get_world_size() if dist.is_initialized() else None
    if group != world:
        size = group or "no group: labkit.launch.init or fake_ranks first"
        raise ValueError(f"world must be the process group's size ({size}), got {world}")
    for layer in model.model.layers:
        layer.self_attn = ParallelLlamaAttention(layer.self_attn, rank, world)
        layer.mlp = ParallelMLP(layer.mlp, rank, world)
    return model
