"""Check labkit.alloc, the model of PyTorch's caching allocator, against the real one on a CUDA GPU.

    python -m labkit.scripts.validate_allocator [--out data/allocator_validation.json] [--layers 4] [--jobs 1]

The allocator reads PYTORCH_CUDA_ALLOC_CONF once, when CUDA starts, so every setting runs in a fresh
process (this script re-runs itself with --child). Each child replays the same traces with
`torch.empty(n, dtype=torch.uint8, device="cuda")` and reports `torch.cuda.max_memory_reserved()`,
`max_memory_allocated()`, the number of flush-and-retry events (`num_alloc_retries`) and the segments of
a snapshot at the end; the parent replays the traces through the model and compares.

Traces: the three synthetic ones of labkit.alloc (growing batch, pinned holes, phases under a memory
fraction) and a Llama training trace at 7B width recorded with `lk.track()` on fake tensors. Then a real
recorded step: `_record_memory_history` is started before the model exists, one training step runs on
the GPU, and the snapshot's own trace (which also holds what lk.track cannot see, such as cuBLAS's
workspace) is replayed through the model.

A child that fails (a traceback, no RESULT line, a timeout) fails the whole run: exit status 1, the
child's stderr printed. Written against the documented torch.cuda API (memory_stats, max_memory_reserved, _snapshot,
_record_memory_history, set_per_process_memory_fraction). Budget: under 5 minutes on one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = ["", "max_split_size_mb:128", "roundup_power2_divisions:4", "expandable_segments:True",
            "garbage_collection_threshold:0.5"]
PHASE_DEVICE = 500 << 20


def traces(layers, trace_file):
    """name -> (trace, memory fraction of PHASE_DEVICE or None)."""
    from labkit import alloc
    out = {"growing_batch": (alloc.growing_batch(), None), "pinned_holes": (alloc.pinned_holes(), None),
           "phases": (alloc.phases(PHASE_DEVICE), PHASE_DEVICE)}
    path = pathlib.Path(trace_file)
    if not path.exists():
        import torch
        import labkit as lk
        model = lk.models.build("llama-2-7b", "full", dtype=torch.bfloat16, device="fake", num_hidden_layers=layers)
        with model.fake_mode:
            opt = torch.optim.AdamW(model.parameters(), foreach=False)
            ids = torch.randint(0, model.config.vocab_size, (4, 1024))
            with lk.track(model, opt) as mem:
                for _ in range(2):
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([[str(k), n] for k, n, _ in mem.trace]))
    out["llama_7b_width"] = ([(k, n) for k, n in json.loads(path.read_text())], None)
    return out


def play(trace, device):
    """Replay `trace` with real tensors on `device`: (key, +bytes, ...) allocates, (key, -bytes, ...) frees.

    Events are (key, nbytes) or (key, nbytes, category), as labkit.alloc's traces and lk.track's are; a live
    key allocated again is replaced (the new tensor first, then the old one freed, as the model does).
    Returns (the tensors still held, the index of the event that ran out of memory or None)."""
    import torch
    held = {}
    for i, event in enumerate(trace):
        key, n = event[0], event[1]
        if n > 0:
            try:
                held[key] = torch.empty(n, dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError:
                return held, i
        else:
            held.pop(key, None)
    return held, None


def child(conf, layers, trace_file):
    """Runs in a fresh process with PYTORCH_CUDA_ALLOC_CONF=conf: the real allocator on each trace."""
    import torch
    results = {}
    total = torch.cuda.get_device_properties(0).total_memory
    for name, (trace, limit) in traces(layers, trace_file).items():
        if limit is not None:
            torch.cuda.set_per_process_memory_fraction(limit / total)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        base = torch.cuda.memory_reserved()
        held, oom = play(trace, "cuda")
        torch.cuda.synchronize()
        segs = sorted(s["total_size"] for s in torch.cuda.memory._snapshot()["segments"])
        results[name] = dict(peak_reserved=torch.cuda.max_memory_reserved() - base,
                             peak_allocated=torch.cuda.max_memory_allocated(),
                             retries=torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0,
                             segments_end=segs, oom_at=oom)
        del held
        torch.cuda.empty_cache()
        if limit is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    results["recorded_step"] = recorded_step(layers)
    print("RESULT " + json.dumps(results))


def recorded_step(layers):
    """One real training step with history on from the start; its own trace, as (addr, +/-size) events."""
    import torch
    import labkit as lk
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    model = lk.models.build("llama-2-7b", "full", dtype=torch.bfloat16, device="cuda", num_hidden_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    ids = torch.randint(0, model.config.vocab_size, (4, 1024), device="cuda")
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = []
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            events.append((e["addr"], e["size"]))
        elif e["action"] == "free_completed":
            events.append((e["addr"], -e["size"]))
    return dict(peak_reserved=torch.cuda.max_memory_reserved(), peak_allocated=torch.cuda.max_memory_allocated(),
                events=events, dropped=len(snap["device_traces"][0]) >= 1_000_000)


class ChildFailed(RuntimeError):
    """A child process (one allocator setting) died or printed no result: its exit status and stderr."""

    def __init__(self, conf, returncode, stderr):
        self.conf, self.returncode, self.stderr = conf, returncode, stderr
        super().__init__(f"the child for PYTORCH_CUDA_ALLOC_CONF={conf!r} failed (exit {returncode}) "
                         f"without a result; its output ends:\n{stderr[-4000:]}")


def child_command(conf, layers, trace_file):
    return [sys.executable, "-m", "labkit.scripts.validate_allocator", "--child", conf,
            "--layers", str(layers), "--trace", str(trace_file)]


def run_child(command, conf, timeout=240):
    """Run one child with PYTORCH_CUDA_ALLOC_CONF=conf; its RESULT as a dict, or ChildFailed."""
    # torch >= 2.9 reads PYTORCH_ALLOC_CONF first and the older PYTORCH_CUDA_ALLOC_CONF where it is unset: set both
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTORCH_ALLOC_CONF": conf}
    try:
        run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise ChildFailed(conf, f"killed after {timeout} s", err) from None
    line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT ")), None)
    if run.returncode != 0 or line is None:
        raise ChildFailed(conf, run.returncode, run.stderr or run.stdout)
    return json.loads(line[len("RESULT "):])


def compare(sets, conf, real, total):
    """Rows comparing the model's replay of each trace with what the real allocator did under `conf`."""
    from labkit.alloc import replay
    rows = []
    for name, (trace, limit) in sets.items():
        kw = dict(device=total, fraction=limit / total) if limit else {}
        m = replay(trace, conf, **kw)
        segs = sorted(s["total_size"] for s in m.snapshot()["segments"])
        r = real[name]
        rows.append(dict(trace=name, conf=conf or "default", real_peak_reserved=r["peak_reserved"],
                         model_peak_reserved=m.peak_reserved, real_peak_allocated=r["peak_allocated"],
                         model_peak_allocated=m.peak_allocated, real_retries=r["retries"], model_retries=m.retries,
                         segments_match=segs == r["segments_end"], real_oom_at=r["oom_at"], model_oom_at=m.oom_at,
                         exact=m.peak_reserved == r["peak_reserved"] and segs == r["segments_end"]))
    step = real["recorded_step"]
    m = replay(step["events"], conf)
    rows.append(dict(trace="recorded_step", conf=conf or "default", real_peak_reserved=step["peak_reserved"],
                     model_peak_reserved=m.peak_reserved, real_peak_allocated=step["peak_allocated"],
                     model_peak_allocated=m.peak_allocated, events=len(step["events"]),
                     history_truncated=step["dropped"], exact=m.peak_reserved == step["peak_reserved"]))
    return rows


def validate(layers=4, trace_file=ROOT / "build" / "allocator_llama_trace.json", jobs=1, timeout=240,
             settings=SETTINGS, command=child_command, total=None):
    """Every setting's child run (`jobs` at a time), compared with the model: the rows, or ChildFailed.

    Children run concurrently only where the GPU holds them all (each keeps its own caching allocator,
    so their figures do not mix); any child that fails raises, after all have finished.
    total: the device's bytes (default: GPU 0's), for the trace run under a memory fraction."""
    import concurrent.futures
    sets = traces(layers, trace_file)           # record the fake trace once, in this process
    if total is None:
        import torch
        total = torch.cuda.get_device_properties(0).total_memory
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {conf: pool.submit(run_child, command(conf, layers, trace_file), conf, timeout) for conf in settings}
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    for e in failed:
        if not isinstance(e, ChildFailed):
            raise e
    if failed:
        raise failed[0] if len(failed) == 1 else ChildFailed(
            ", ".join(e.conf or "default" for e in failed), "several",
            "\n\n".join(f"--- {e.conf or 'default'}:\n{e.stderr[-2000:]}" for e in failed))
    rows = []
    for conf, future in futures.items():
        rows += compare(sets, conf, future.result(), total)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "data" / "allocator_validation.json"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--trace", default=str(ROOT / "build" / "allocator_llama_trace.json"))
    p.add_argument("--jobs", type=int, default=1, help="children at a time (each needs about 12 GiB at 4 layers)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers must be a positive number of decoder layers, got {args.layers}")
    if args.jobs < 1:
        p.error(f"--jobs must be a positive number of children at a time, got {args.jobs}")
    if args.child is not None:
        return child(args.child, args.layers, args.trace)
    from labkit.records import unwritable
    for flag, path in (("--out", pathlib.Path(args.out).parent), ("--trace", pathlib.Path(args.trace).parent)):
        problem = unwritable(path)         # found now, not after minutes of GPU work
        if problem:
            p.error(f"{flag} {path}: {problem}")
    import torch
    if not torch.cuda.is_available():
        print(f"validate_allocator needs a CUDA GPU, and torch {torch.__version__} sees none here (CUDA build: "
              f"{torch.version.cuda or 'none'}). Nothing was measured or written.", file=sys.stderr)
        return 2
    start = time.time()
    try:
        rows = validate(args.layers, args.trace, args.jobs)
    except ChildFailed as e:
        print(f"validate_allocator FAILED: {e}", file=sys.stderr)
        return 1
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, seconds=round(time.time() - start, 1),
               rows=rows)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    for row in rows:
        print(row)
    print(f"{sum(r.get('exact', False) for r in rows)} of {len(rows)} rows agree exactly; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
