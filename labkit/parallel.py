"""Tensor parallelism from scratch (Megatron-LM, Shoeybi et al. 2019, sec. 3) and a torchrun launcher.

Column-parallel linear:  Y = X W^T with W split along its output dimension: rank i computes Y_i = X W_i^T.
Row-parallel linear:     W split along its input dimension: rank i computes X_i W_i^T, and the sum over
                         ranks (an all-reduce) is Y.
An MLP is column-parallel then row-parallel, so the pieces never need gathering in between:
    f = copy to the ranks   (forward: identity,   backward: all-reduce the input gradient)
    g = reduce from ranks   (forward: all-reduce, backward: identity)
one all-reduce in forward and one in backward per block. `COMM` counts the bytes each rank all-reduces.
Pipeline parallelism: `balanced_split` cuts the layers into stages of equal cost, `replay` times a
schedule's per-stage order of forward and backward chunks in units of work, so bubbles can be counted.
The ranks import this module from scripts started by `torchrun` (see `launch`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["COMM", "copy_to_parallel", "reduce_from_parallel", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelMLP", "ParallelAttention", "balanced_split", "replay", "launch", "progress", "init", "finish", "write_result"]

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
                              for j in range(k - 1, i)), key=lambda t: t[0])
    cuts = best[parts, n][1]
    return list(zip(cuts[:-1], cuts[1:]))


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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module, nproc=2, args=(), timeout=300):
    """Run `python -m torch.distributed.run --nproc-per-node nproc -m module args` on this machine.

    The ranks write their result to the JSON file named by the environment variable LABKIT_RESULT;
    it is returned as a dict. `module` may be a list of modules: one torchrun runs them one after
    another in the same processes (starting Python, torch and transformers costs more than a tiny
    lesson's work) and their results come back as a list. Lines the ranks print through `progress`
    are shown as they come; the rest of their output only if a rank fails. A rank that fails or a run
    past `timeout` seconds raises RuntimeError with the end of the output, and never leaves processes
    behind.
    """
    modules = [module] if isinstance(module, str) else list(module) if isinstance(module, (list, tuple)) else []
    if not modules or not all(isinstance(m, str) for m in modules):
        raise ValueError(f"module must be a module name or a list of them, got {module!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    name = module if isinstance(module, str) else " + ".join(modules)
    with tempfile.TemporaryDirectory() as tmp:
        results = [os.path.join(tmp, f"result{i}.json") for i in range(len(modules))]
        target = ["-m", modules[0], *map(str, args)] if len(modules) == 1 else ["-m", "labkit.scripts.chain", *modules]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", "--max-restarts=0", *target]
        env = dict(os.environ, LABKIT_RESULT=os.pathsep.join(results), OMP_NUM_THREADS="1")
        print(f"torchrun: {nproc} ranks of {name}", flush=True)
        with open(os.path.join(tmp, "stderr"), "w+") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                    start_new_session=True)          # its own process group, to stop it whole
            lines = []
            reader = threading.Thread(target=_forward, args=(proc.stdout, lines), daemon=True)
            reader.start()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                _stop(proc)
                raise RuntimeError(f"{name} with {nproc} ranks ran past {timeout} s and was stopped") from e
            except BaseException:                                    # e.g. the learner interrupts the cell
                _stop(proc)
                raise
            finally:
                reader.join(timeout=10)
            err.seek(0)
            lines += err.read().splitlines()
        if proc.returncode != 0 or not all(os.path.exists(r) for r in results):
            ranks = [l for l in lines if l.startswith("[rank")]        # the ranks' own tracebacks
            tail = "\n".join((ranks or lines)[-40:])
            raise RuntimeError(f"{name} with {nproc} ranks failed (exit {proc.returncode}):\n{tail}")
        out = []
        for r in results:
            with open(r) as f:
                out.append(json.load(f))
        return out[0] if isinstance(module, str) else out


def _stop(proc):
    """torchrun stops its ranks (they run in sessions of their own) on SIGTERM; then its group is killed."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_PROGRESS = "[labkit progress] "


def _forward(stream, lines):
    start = time.perf_counter()
    for line in stream:
        line = line.rstrip("\n")
        lines.append(line)
        if line.startswith(_PROGRESS):
            print(f"  {time.perf_counter() - start:5.1f} s  {line[len(_PROGRESS):]}", flush=True)


def progress(message):
    """Called by a torchrun script: rank 0 says how far it got; `launch` shows it in the notebook."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(_PROGRESS + message, flush=True)


def init():
    """Join the process group torchrun set up: NCCL when every local rank has its own GPU, else gloo
    on CPUs (also on a one-GPU machine running two ranks); returns this rank's device. In a chain of
    scripts (`labkit.scripts.chain`) the group is joined once and kept."""
    if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return device


def finish():
    """Called at the end of a torchrun script: leave the process group, unless a chain of scripts
    still needs it (joining a second time in the same processes can hang)."""
    if os.environ.get("LABKIT_CHAINED") != "1":
        dist.destroy_process_group()


def write_result(data):
    """Called on rank 0 by a torchrun script: save `data` for `launch`."""
    paths = os.environ.get("LABKIT_RESULT")
    if paths:
        with open(paths.split(os.pathsep)[0], "w") as f:
            json.dump(data, f)
