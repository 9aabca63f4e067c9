"""Start a lesson's ranks with torchrun from a notebook, and the few calls a rank makes back.

In the notebook:  `launch("labkit.scripts.tensor_parallel", nproc=2)` runs
                  `python -m torch.distributed.run --nproc-per-node 2 -m labkit.scripts.tensor_parallel`,
                  shows the ranks' `progress` lines as they come and returns rank 0's `write_result` data.
In a rank:        `init()` (join the process group: NCCL when every rank has a GPU, else gloo on CPUs),
                  `progress(message)`, `write_result(data)`, `finish()`.
One rank alone:   `with fake_ranks(8):` makes this process rank 0 of 8 in a fake process group (PyTorch's own,
                  `torch.testing._internal.distributed.fake_pg`): every collective returns at once and moves
                  nothing, so one process holds exactly one rank's share of a layout that needs 8 devices.
Functions defined in a notebook cannot be pickled into spawned processes, hence the script files in
labkit/scripts/. The layers the ranks import are in `labkit.tensor_parallel`, `labkit.pipeline_parallel` and
`labkit.zero`, the collective counter in `labkit.collectives`.
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

from .checks import count, index

__all__ = ["launch", "progress", "init", "finish", "leave", "write_result", "backend_for", "where_ranks_run", "fake_ranks"]


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
    nproc = count("nproc", nproc)
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
        print(f"torchrun: starting {nproc} ranks of {name} (each loads Python, torch and transformers first: "
              "several seconds)", flush=True)
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
            ranks = [l for l in lines if l.startswith("[rank")         # the ranks' own tracebacks, and what
                     or "terminate called" in l or "what():" in l]      # C++ said before an abort (SIGABRT)
            tail = "\n".join((ranks or lines)[-40:])
            raise RuntimeError(f"{name} with {nproc} ranks failed (exit {proc.returncode}):\n{tail}")
        missing = [m for m, r in zip(modules, results) if not os.path.exists(r)]
        if missing:
            tail = "\n".join(lines[-40:]) or "(the ranks printed nothing)"
            raise RuntimeError(f"{name} with {nproc} ranks exited 0 but {', '.join(missing)} wrote no result: "
                               f"rank 0 must call labkit.launch.write_result(data) before it ends. "
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
        # two ranks writing at once can run their lines together: each progress message starts at its prefix
        for part in line.split(_PROGRESS)[1:]:
            print(f"  {time.perf_counter() - start:5.1f} s  {part.strip()}", flush=True)


def progress(message, every_rank=False):
    """Called by a torchrun script: rank 0 says how far it got (every rank, prefixed with its number, when
    `every_rank`); `launch` shows each line in the notebook as it comes, with the seconds since the start."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    if every_rank or rank == 0:                   # one write per line, so ranks' lines do not interleave
        sys.stdout.write(f"{_PROGRESS}{f'rank {rank}: ' if every_rank else ''}{message}\n")
        sys.stdout.flush()


def backend_for(nproc):
    """("nccl", "cuda") when this machine has a GPU for each of `nproc` ranks, else ("gloo", "cpu"): NCCL
    refuses two ranks on one GPU, so one GPU and two ranks means two CPU processes and an idle GPU."""
    return ("nccl", "cuda") if torch.cuda.device_count() >= nproc else ("gloo", "cpu")


def where_ranks_run(nproc):
    """One sentence for a notebook: where `nproc` ranks on this machine will run, and what that leaves out."""
    gpus = torch.cuda.device_count()
    backend, device = backend_for(nproc)
    if device == "cuda":
        return f"{nproc} ranks on {gpus} GPUs: one GPU per rank, NCCL's collectives"
    idle = f"; the {'GPU does' if gpus == 1 else f'{gpus} GPUs do'} nothing in them" if gpus else ""
    return (f"{nproc} ranks on {gpus} GPU(s): the ranks are CPU processes and talk over gloo{idle}. "
            "Sharding, bytes per rank and bytes sent are the same there; NCCL's speed and each rank's own GPU "
            "memory need one GPU per rank")


def init():
    """Join the process group torchrun set up: NCCL when every local rank has its own GPU, else gloo
    on CPUs (also on a one-GPU machine running two ranks: see `where_ranks_run`); returns this rank's device.
    Every rank says when it has joined. In a chain of scripts (`labkit.scripts.chain`) the group is joined
    once and kept."""
    backend, kind = backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    device = torch.device(kind, int(os.environ.get("LOCAL_RANK", 0))) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend)
        progress(f"joined the process group ({backend}, {device})", every_rank=True)
    return device


def finish():
    """Called at the end of a torchrun script: leave the process group and end the process (`leave()`: nothing
    after this call runs), unless a chain of scripts still needs both (joining a second time in the same
    processes can hang). Every rank waits for the others first: a gloo rank that leaves while a peer still
    receives its last message can abort (SIGABRT)."""
    if os.environ.get("LABKIT_CHAINED") != "1":
        leave()


def leave():
    """The last thing a rank does: wait for the others, leave the process group, and end the process without
    Python's and C++'s teardown. After all its work and the barrier, a gloo rank was seen to abort at teardown
    ("terminate called without an active exception": a C++ thread still joinable when its owner is destroyed),
    which fails the whole torchrun; os._exit skips those destructors once the output is flushed."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def write_result(data):
    """Called on rank 0 by a torchrun script: save `data` for `launch`."""
    paths = os.environ.get("LABKIT_RESULT")
    if paths:
        with open(paths.split(os.pathsep)[0], "w") as f:
            json.dump(data, f)


@contextlib.contextmanager
def fake_ranks(world, rank=0):
    """This process as rank `rank` of `world` ranks, in a fake process group, for the block; then none.

    PyTorch's "fake" backend (registered by torch.testing._internal.distributed.fake_pg, what torchtitan's
    memory estimator uses) answers every collective at once without communicating: an all-gather's output
    or an all-reduce's result is left as it was (wrong values), but every tensor a real rank would allocate
    is allocated here, with its real shape. So one process, on real tensors or on FakeTensorMode ones,
    measures the memory of one rank of a layout over `world` devices (FSDP2, DTensor, labkit.zero and
    labkit.tensor_parallel all run on it unchanged). Not for values: a result computed here is not the result.
    """
    world = count("world", world)
    rank = index("rank", rank, world)
    if dist.is_initialized():
        raise RuntimeError(f"a process group is already running here (backend {dist.get_backend()!r}, world "
                           f"{dist.get_world_size()}): fake_ranks makes its own; leave the other one first")
    from torch.testing._internal.distributed.fake_pg import FakeStore     # registers the "fake" backend
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
