"""Tensor parallelism from scratch (Megatron-LM, Shoeybi et al. 2019, sec. 3) and pipeline schedules counted.

Column-parallel linear:  Y = X W^T with W split along its output dimension: rank i computes Y_i = X W_i^T.
Row-parallel linear:     W split along its input dimension: rank i computes X_i W_i^T, and the sum over
                         ranks (an all-reduce) is Y.
An MLP is column-parallel then row-parallel, so the pieces never need gathering in between:
    f = copy to the ranks   (forward: identity,   backward: all-reduce the input gradient)
    g = reduce from ranks   (forward: all-reduce, backward: identity)
one all-reduce in forward and one in backward per block. `COMM` counts the bytes each rank all-reduces.
Pipeline parallelism: `balanced_split` cuts the layers into stages of equal cost, `replay` times a
schedule's per-stage order of forward and backward chunks in units of work, so bubbles can be counted.
The ranks import this module from scripts started by `torchrun`: `labkit.launch` starts them, and the
old names `labkit.parallel.launch`, `init`, `progress`, `finish`, `write_result` and `process_group_calls`
(now in `labkit.collectives`) still work.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import process_group_calls
from .launch import _alive, _free_port, finish, init, launch, progress, write_result   # their old home: kept

__all__ = ["COMM", "CopyToParallel", "ReduceFromParallel", "copy_to_parallel", "reduce_from_parallel", "counted_all_reduce",
           "shard_weight", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelAttention",
           "ParallelLlamaAttention", "shard_llama",
           "balanced_split", "gpipe", "one_f_one_b", "replay",
           "launch", "progress", "init", "finish", "write_result", "process_group_calls"]

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
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
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
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads // world
        self.kv_heads = cfg.num_key_value_heads // world
        if self.kv_heads == 0:
            raise ValueError(f"num_key_value_heads ({cfg.num_key_value_heads}) must be at least the world size {world}")
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
    for layer in model.model.layers:
        layer.self_attn = ParallelLlamaAttention(layer.self_attn, rank, world)
        layer.mlp = ParallelMLP(layer.mlp, rank, world)
    return model


def _largest_stage(candidate):                      # (largest stage cost, cuts) -> what balanced_split minimises
    return candidate[0]


def balanced_split(costs, parts):
    """Cut `costs` (one number per layer, in order) into `parts` contiguous, non-empty stages whose
    largest total is as small as possible. Returns [(lo, hi), ...], layer indices [lo, hi) per stage."""
    n = len(costs)
    if not isinstance(parts, int) or not 1 <= parts <= n:
        raise ValueError(f"parts must be an int in [1, {n}] (one layer per stage at least), got {parts!r}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: (largest stage cost, cuts) for the first i layers in k stages
    best = {(1, i): (prefix[i], [0, i]) for i in range(1, n + 1)}
    for k in range(2, parts + 1):
        for i in range(k, n + 1):
            best[k, i] = min(((max(best[k - 1, j][0], prefix[i] - prefix[j]), best[k - 1, j][1] + [i])
                              for j in range(k - 1, i)), key=_largest_stage)
    cuts = best[parts, n][1]
    return list(zip(cuts[:-1], cuts[1:]))


def gpipe(p, m):
    """GPipe's order (Huang et al. 2019): on every one of `p` stages, the forwards of all `m` micro-batches,
    then their backwards. Per stage a list of ("F" | "B", micro-batch) chunks, as `replay` reads them."""
    return [[("F", c) for c in range(m)] + [("B", c) for c in range(m)] for _ in range(p)]


def one_f_one_b(p, m):
    """1F1B, PipeDream-Flush's order (Narayanan et al. 2021, sec. 2.2), what `Schedule1F1B` runs: stage s starts
    with p - 1 - s forwards (warm-up), then alternates one forward, one backward, and ends with the backwards
    left (cool-down). A stage holds at most p - s micro-batches' activations instead of GPipe's m."""
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        order = [("F", c) for c in range(warm)]
        for c in range(m - warm):                           # steady state: one forward, one backward
            order += [("F", warm + c), ("B", c)]
        order += [("B", c) for c in range(m - warm, m)]     # cool-down
        orders.append(order)
    return orders


def replay(orders, costs):
    """Time a pipeline schedule in units of work instead of seconds.

    orders: per stage, its ("F" | "B", micro-batch) chunks in the order the schedule ran them.
    costs:  per stage, {"F": units, "B": units}: how long one chunk takes there.
    A chunk starts when its stage is free and its input is ready: F(s, c) needs F(s-1, c); B(s, c)
    needs B(s+1, c), or F(s, c) on the last stage. Returns per stage [(kind, chunk, start, end)].
    """
    p = len(orders)
    done, free, pos = {}, [0] * p, [0] * p
    timeline = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, chunk = orders[s][pos[s]]
                if kind == "F":
                    dep = ("F", s - 1, chunk) if s > 0 else None
                elif kind == "B":
                    dep = ("B", s + 1, chunk) if s < p - 1 else ("F", s, chunk)
                else:
                    raise ValueError(f"chunk kind must be 'F' or 'B', got {kind!r} on stage {s}")
                if dep is not None and dep not in done:
                    break                                   # wait for the other stage
                start = max(free[s], done.get(dep, 0))
                free[s] = done[kind, s, chunk] = start + costs[s][kind]
                timeline[s].append((kind, chunk, start, free[s]))
                pos[s] += 1
                moved = True
    stuck = {s: orders[s][pos[s]] for s in range(p) if pos[s] < len(orders[s])}
    if stuck:
        raise ValueError(f"the orders deadlock: stage -> chunk it waits on {stuck}")
    return timeline


_Copy, _Reduce = CopyToParallel, ReduceFromParallel      # their names before notebook 09 showed them
_all_reduce, _shard = counted_all_reduce, shard_weight
