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

import contextlib
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

__all__ = ["COMM", "CopyToParallel", "ReduceFromParallel", "copy_to_parallel", "reduce_from_parallel", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelMLP", "ParallelAttention", "balanced_split", "replay", "launch", "progress", "init", "finish", "write_result",
           "process_group_calls"]

COMM = {"all_reduce_calls": 0, "all_reduce_bytes": 0}


def _all_reduce(x):
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
        return _all_reduce(grad.contiguous())


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all-reduce in forward, identity in backward (after a row-parallel layer)."""
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_parallel(x):
    """f: identity forward, all-reduce of the gradient backward."""
    return CopyToParallel.apply(x)


def reduce_from_parallel(x):
    """g: all-reduce forward, identity backward."""
    return ReduceFromParallel.apply(x)


def _shard(weight, dim, rank, world):
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
        self.weight = _shard(linear.weight, 0, rank, world)
        self.bias = None if linear.bias is None else _shard(linear.bias, 0, rank, world)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(torch.nn.Module):
    """This rank's columns of `linear.weight` (its input features); the partial products are all-reduced:
    Y = sum_i X_i W_i^T + b. A bias is whole on every rank and added once, after the all-reduce."""

    def __init__(self, linear, rank, world):
        super().__init__()
        self.weight = _shard(linear.weight, 1, rank, world)
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
    past `timeout` seconds (a positive number) raises RuntimeError with the end of the output, and
    never leaves processes behind: every process of the run is killed, also a rank that ignores
    SIGTERM, and confirmed gone. A run that exits 0 without rank 0's `write_result` says so.
    """
    modules = [module] if isinstance(module, str) else list(module) if isinstance(module, (list, tuple)) else []
    if not modules or not all(isinstance(m, str) for m in modules):
        raise ValueError(f"module must be a module name or a list of them, got {module!r}")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    name = module if isinstance(module, str) else " + ".join(modules)
    tag = f"{os.getpid()}-{time.monotonic_ns()}"          # every process of this run inherits it
    with tempfile.TemporaryDirectory() as tmp:
        results = [os.path.join(tmp, f"result{i}.json") for i in range(len(modules))]
        target = ["-m", modules[0], *map(str, args)] if len(modules) == 1 else ["-m", "labkit.scripts.chain", *modules]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={_free_port()}", "--max-restarts=0", *target]
        env = dict(os.environ, LABKIT_RESULT=os.pathsep.join(results), OMP_NUM_THREADS="1", LABKIT_LAUNCH=tag)
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
                _stop(proc, tag)
                raise RuntimeError(f"{name} with {nproc} ranks ran past {timeout} s and was stopped "
                                   "(torchrun and every rank, confirmed gone)") from e
            except BaseException:                                    # e.g. the learner interrupts the cell
                _stop(proc, tag)
                raise
            finally:
                reader.join(timeout=10)
            err.seek(0)
            lines += err.read().splitlines()
        _stop_tagged(tag)                          # a rank torchrun left behind (it should leave none)
        if proc.returncode != 0:
            ranks = [l for l in lines if l.startswith("[rank")]        # the ranks' own tracebacks
            tail = "\n".join((ranks or lines)[-40:])
            raise RuntimeError(f"{name} with {nproc} ranks failed (exit {proc.returncode}):\n{tail}")
        missing = [m for m, r in zip(modules, results) if not os.path.exists(r)]
        if missing:
            tail = "\n".join(lines[-40:]) or "(the ranks printed nothing)"
            raise RuntimeError(f"{name} with {nproc} ranks exited 0 but {', '.join(missing)} wrote no result: "
                               f"rank 0 must call labkit.parallel.write_result(data) before it ends. "
                               f"Output:\n{tail}")
        out = []
        for r in results:
            with open(r) as f:
                out.append(json.load(f))
        return out[0] if isinstance(module, str) else out


def _stop(proc, tag, grace=5.0):
    """Stop torchrun and every rank. The ranks run in sessions of their own, so killing torchrun's group
    misses them, and a rank that ignores SIGTERM outlives torchrun (on a GPU keeping its memory). Every
    process of the run carries LABKIT_LAUNCH=tag in its environment: each gets SIGTERM, then after `grace`
    seconds SIGKILL, and is confirmed gone (RuntimeError if one survives)."""
    pids = set(_tagged(tag)) | {proc.pid}
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        proc.poll()
        time.sleep(0.1)
    pids |= set(_tagged(tag))
    _signal([p for p in pids if _alive(p)], signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    _stop_tagged(tag)


def _stop_tagged(tag):
    """SIGKILL what is left of a run and wait until it is gone; raise if anything survives 10 s."""
    left = [p for p in _tagged(tag) if _alive(p)]
    _signal(left, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if _alive(p)]
    if left:
        raise RuntimeError(f"processes {left} of this torchrun survived SIGKILL")


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _tagged(tag):
    """The ids of the processes whose environment holds LABKIT_LAUNCH=tag (Linux /proc, else psutil)."""
    needle = f"LABKIT_LAUNCH={tag}".encode()
    if os.path.isdir("/proc/self"):
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if needle in f.read().split(b"\0"):
                            found.append(int(entry))
                except OSError:
                    pass
        return found
    try:
        import psutil
    except ImportError:
        return []
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("LABKIT_LAUNCH") == tag:
                found.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return found


def _alive(pid):
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


# Collectives as the process group receives them: each method, the argument holding the bytes sent
# (an all-reduce's tensors, a reduce-scatter's input, an all-gather's output), and what to call it.
# torch 2.13 names them all_gather_single / reduce_scatter_single, earlier releases _allgather_base / ...
_PG_METHODS = {"allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
               "reduce_scatter_single": ("reduce_scatter", 1), "_reduce_scatter_base": ("reduce_scatter", 1),
               "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
               "all_gather_single": ("all_gather", 0), "_allgather_base": ("all_gather", 0),
               "allgather_into_tensor_coalesced": ("all_gather", 0), "allgather": ("all_gather", 0)}


# Keyword names the process group's methods take for the argument that holds the bytes.
_PG_KEYWORDS = {0: ("tensors", "tensor", "output", "output_tensor", "output_tensors", "outputs"),
                1: ("input", "input_tensor", "input_tensors", "inputs")}
_PG_ACTIVE = []                       # the count dicts of the process_group_calls blocks now open
_PG_SAVED = {}                        # the class's own methods while any block is open


def _pg_bytes(t):
    while isinstance(t, (list, tuple)) and t and isinstance(t[0], (list, tuple)):   # [[t, ...]]
        t = [x for inner in t for x in inner]
    return sum(x.nbytes for x in t) if isinstance(t, (list, tuple)) else t.nbytes


def _pg_counted(name):
    kind, arg = _PG_METHODS[name]

    def call(self, *args, **kwargs):
        t = args[arg] if len(args) > arg else next((kwargs[k] for k in _PG_KEYWORDS[arg] if k in kwargs), None)
        n = 0 if t is None else _pg_bytes(t)
        for counts in _PG_ACTIVE:
            counts[kind] += n
            counts["calls"] += 1
        return _PG_SAVED[name].__get__(self, type(self))(*args, **kwargs)
    return call


@contextlib.contextmanager
def process_group_calls():
    """Bytes of every collective this rank's process group is asked to run, counted in the ProcessGroup's own
    methods (whatever code calls them, so a count independent of the caller's bookkeeping):
    {"all_reduce": bytes, "reduce_scatter": bytes (input), "all_gather": bytes (output), "calls": n}.
    Blocks may nest or close in any order; each counts what ran while it was open. Not counted:
    functional collectives (torch.distributed._functional_collectives, which DTensor uses)."""
    import torch.distributed as dist
    counts = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "calls": 0}
    if not _PG_ACTIVE:
        # The class's own entries (pybind's instancemethod descriptors): restoring them keeps `self` bound.
        _PG_SAVED.update({n: vars(dist.ProcessGroup)[n] for n in _PG_METHODS if n in vars(dist.ProcessGroup)})
        for name in _PG_SAVED:
            setattr(dist.ProcessGroup, name, _pg_counted(name))
    _PG_ACTIVE.append(counts)
    try:
        yield counts
    finally:
        del _PG_ACTIVE[next(i for i, c in enumerate(_PG_ACTIVE) if c is counts)]   # by identity: dicts compare equal
        if not _PG_ACTIVE:
            for name, method in _PG_SAVED.items():
                setattr(dist.ProcessGroup, name, method)
            _PG_SAVED.clear()


_Copy, _Reduce = CopyToParallel, ReduceFromParallel      # their names before notebook 09 showed them
