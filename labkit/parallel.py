"""Tensor parallelism from scratch (Megatron-LM, Shoeybi et al. 2019, sec. 3) and a torchrun launcher.

Column-parallel linear:  Y = X W^T with W split along its output dimension: rank i computes Y_i = X W_i^T.
Row-parallel linear:     W split along its input dimension: rank i computes X_i W_i^T, and the sum over
                         ranks (an all-reduce) is Y.
An MLP is column-parallel then row-parallel, so the pieces never need gathering in between:
    f = copy to the ranks   (forward: identity,   backward: all-reduce the input gradient)
    g = reduce from ranks   (forward: all-reduce, backward: identity)
one all-reduce in forward and one in backward per block. `COMM` counts the bytes each rank all-reduces.
The ranks import this module from scripts started by `torchrun` (see `launch`).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["COMM", "copy_to_parallel", "reduce_from_parallel", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelMLP", "ParallelAttention", "launch", "init", "write_result"]

COMM = {"all_reduce_calls": 0, "all_reduce_bytes": 0}


def _all_reduce(x):
    COMM["all_reduce_calls"] += 1
    COMM["all_reduce_bytes"] += x.nbytes
    dist.all_reduce(x)
    return x


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous())


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_parallel(x):
    """f: identity forward, all-reduce of the gradient backward."""
    return _Copy.apply(x)


def reduce_from_parallel(x):
    """g: all-reduce forward, identity backward."""
    return _Reduce.apply(x)


def _shard(weight, dim, rank, world):
    if weight.shape[dim] % world:
        raise ValueError(f"dimension {dim} of the weight ({weight.shape[dim]}) must divide by the world size {world}")
    return torch.nn.Parameter(weight.detach().chunk(world, dim)[rank].clone())


class ColumnParallelLinear(torch.nn.Module):
    """This rank's rows of `linear.weight` (its output features): Y_i = X W_i^T. No bias (Llama has none)."""

    def __init__(self, linear, rank, world):
        super().__init__()
        self.weight = _shard(linear.weight, 0, rank, world)

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallelLinear(torch.nn.Module):
    """This rank's columns of `linear.weight` (its input features); the partial products are all-reduced."""

    def __init__(self, linear, rank, world):
        super().__init__()
        self.weight = _shard(linear.weight, 1, rank, world)

    def forward(self, x_i):
        return reduce_from_parallel(F.linear(x_i, self.weight))


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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module, nproc=2, args=(), timeout=300):
    """Run `python -m torch.distributed.run --nproc-per-node nproc -m module args` on this machine.

    The ranks write their result to the JSON file named by the environment variable LABKIT_RESULT;
    it is returned as a dict. A rank that fails or a run past `timeout` seconds raises RuntimeError
    with the end of the output, and never leaves processes behind.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", "--max-restarts=0", "-m", module, *map(str, args)]
        env = dict(os.environ, LABKIT_RESULT=result, OMP_NUM_THREADS="1")
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{module} with {nproc} ranks ran past {timeout} s and was stopped") from e
        if done.returncode != 0 or not os.path.exists(result):
            lines = (done.stdout + done.stderr).splitlines()
            ranks = [l for l in lines if l.startswith("[rank")]        # the ranks' own tracebacks
            tail = "\n".join((ranks or lines)[-40:])
            raise RuntimeError(f"{module} with {nproc} ranks failed (exit {done.returncode}):\n{tail}")
        with open(result) as f:
            return json.load(f)


def init():
    """Join the process group torchrun set up: NCCL when every local rank has its own GPU, else gloo
    on CPUs (also on a one-GPU machine running two ranks); returns this rank's device."""
    if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def write_result(data):
    """Called on rank 0 by a torchrun script: save `data` for `launch`."""
    path = os.environ.get("LABKIT_RESULT")
    if path:
        with open(path, "w") as f:
            json.dump(data, f)
