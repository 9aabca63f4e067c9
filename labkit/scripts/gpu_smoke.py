"""`make gpu-smoke`: the checks that matter most on a CUDA GPU, within 5 minutes, each one JSON line in data/gpu/.

    python -m labkit.scripts.gpu_smoke [--budget 300] [--started EPOCH] [--only flash,tf32] [--out data/gpu] [--list]

Most valuable first (labkit.records.GPU_CHECKS lists them): tests/test_gpu.py (lk.track against the CUDA
caching allocator), the allocator model against the real allocator (validate_allocator), the Triton
flash-attention kernel against SDPA, TF32 off and on, the Triton matmul against cuBLAS, a CUDA graph's
private pool, pinned against pageable copies, a copy overlapped on a side stream, bitsandbytes 4-bit at
batch 1; then, while time remains, each notebook's largest full-size step (its FULL_STEPS) run for real
under a memory cap of lk.CARD (24 GiB) less lk.HEADROOM (contract 1 checked on the allocator itself): peak
tracked, peak allocated and reserved against the estimate, and its time.

Each result is appended as one JSON line to data/gpu/<gpu name>.jsonl: "gpu", "date", "check", "torch",
"cuda", "status" (ok / failed / skipped), "seconds" and the check's figures, or "error" / "reason".
Notebooks read them with `labkit.records.show_gpu(check)`.

The checks run in a worker process, one after another; each has a deadline (its own seconds, and never
past the whole budget). A check that raises records its error and the worker starts afresh (a CUDA error
can leave the context unusable); one that overruns is killed and recorded as timed out; the run goes on.
A summary ends the run; the exit status is 1 if any check failed, 2 without a CUDA GPU.

Needs only a CUDA torch (2.11 or 2.13), numpy and transformers; pytest for tests/test_gpu.py, triton for
the Triton checks, bitsandbytes for the 4-bit one: a check whose package is missing says it was skipped.

Why one file of about 900 lines (over the ~500 the others keep to): it is what a borrowed GPU machine runs
in one call, and each `check_*` function is short and stands alone, like a test file; the harness (worker,
deadlines, records) is the first third. Splitting it would spread one device run over several files.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import importlib
import importlib.util
import json
import math
import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time
import traceback

STARTED = time.time()          # this script's start: the budget's origin unless --started names an earlier one
ROOT = pathlib.Path(__file__).resolve().parents[2]
BUDGET_S = 300                 # the whole command, counted from its start (make's --started): 5 minutes
END_S = 10                     # of the budget, kept for the last kill, the summary and make's exit
MIN_START_S = 8                # a check is not started with less than this left of the budget
GRACE_S = 10                   # past its deadline, a check gets this long to return before it is killed
MARK = "@@gpu-smoke "          # the worker's protocol lines on stdout: "start NAME" or "result {json}"
GiB = 2**30


class Skip(Exception):
    """Raised by a check that cannot run here (a missing package, no FULL_STEPS): recorded as skipped."""


Check = collections.namedtuple("Check", "name fn seconds needs")


class Context:
    """What a check gets: its deadline (time.monotonic() seconds), the repository root, a folder for files,
    and the device ("cuda"; the tests run the checks that can on "cpu", at small sizes)."""

    def __init__(self, deadline, root=ROOT, device="cuda"):
        self.deadline, self.root, self.device = deadline, pathlib.Path(root), device
        self.build = self.root / "build" / "gpu"

    def left(self):
        return self.deadline - time.monotonic()


# ---- records --------------------------------------------------------------------------------------
def gpu_file_name(gpu):
    """data/gpu/<this>.jsonl: the GPU's name with anything but letters, digits, '.', '_', '-' made '_'."""
    if not isinstance(gpu, str) or not gpu.strip():
        raise ValueError(f"gpu must be a GPU's name like 'NVIDIA H200', got {gpu!r}")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", gpu.strip()).strip("._") + ".jsonl"


def json_safe(value, key="figure"):
    """A JSON value for a record: 0-d tensors and numpy scalars as numbers, NaN/inf as text, nested
    lists and dicts kept; anything else is refused, naming the figure."""
    if hasattr(value, "item") and not isinstance(value, (bool, int, float, str)):
        try:
            value = value.item()                   # torch / numpy scalars (an array of many refuses)
        except (ValueError, RuntimeError) as e:
            raise TypeError(f"figure {key} must be one number, got {type(value).__name__} ({e})") from None
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)     # standard JSON has no NaN or Infinity
    if isinstance(value, (list, tuple)):
        return [json_safe(v, key) for v in value]
    if isinstance(value, dict):
        return {str(k): json_safe(v, f"{key}.{k}") for k, v in value.items()}
    raise TypeError(f"figure {key} must be a number, a string, a bool or a list/dict of them, got {value!r}")


def write_record(folder, env, check, status, seconds, **fields):
    """Append one record (one line) to folder/<gpu>.jsonl; returns (path, the record).

    env: {"gpu": ..., "torch": ..., "cuda": ...} of this machine; fields: the figures, or error / reason."""
    from labkit.records import GPU_CHECKS, GPU_RUNS
    if check not in GPU_CHECKS and check not in GPU_RUNS:
        raise ValueError(f"check must be one of {', '.join(GPU_CHECKS)} or make test-gpu's {', '.join(GPU_RUNS)}; "
                         f"got {check!r}")
    if status not in ("ok", "failed", "skipped"):
        raise ValueError(f"status must be 'ok', 'failed' or 'skipped', got {status!r}")
    rec = {"gpu": env["gpu"], "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "check": check, "torch": env["torch"], "cuda": env.get("cuda"), "status": status,
           "seconds": round(float(seconds), 1)}
    clash = set(rec) & set(fields)
    if clash:
        raise ValueError(f"figures must not reuse the record's own keys, got {sorted(clash)}")
    rec.update({k: json_safe(v, k) for k, v in fields.items()})
    line = json.dumps(rec, allow_nan=False)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / gpu_file_name(env["gpu"])
    with open(path, "a", encoding="utf-8") as f:          # one write of one whole line: never half a record
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path, rec


# ---- the worker: runs checks one after another, reports each on stdout ------------------------------
def _registry(ref):
    module, _, attr = ref.partition(":")
    return {c.name: c for c in getattr(importlib.import_module(module), attr or "CHECKS")}


def _say(kind, payload):
    print(MARK + kind + " " + payload, flush=True)


def run_one(check, until, root=ROOT):
    """One check in this process: (status, figures or {"error"/"reason": ...}); never raises."""
    if until - time.monotonic() < MIN_START_S:
        return "skipped", {"reason": f"out of time: {max(0.0, until - time.monotonic()):.0f} s of the budget left"}
    deadline = min(until, time.monotonic() + check.seconds)
    missing = [m for m in check.needs if importlib.util.find_spec(m) is None]
    if missing:
        return "skipped", {"reason": f"{', '.join(missing)} is not installed here (see README: GPU smoke test)"}
    try:
        figures = json_safe(check.fn(Context(deadline, root)) or {})
    except Skip as e:
        return "skipped", {"reason": str(e)}
    except BaseException as e:                                      # noqa: BLE001 (recorded, then the run goes on)
        tb = traceback.format_exc(limit=-6)
        return "failed", {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": tb[-4000:]}
    problems = figures.pop("problems", None) or []
    if problems:
        return "failed", {"error": "; ".join(problems)[:2000], **figures}
    return "ok", figures


def worker(names, until, registry="labkit.scripts.gpu_smoke:CHECKS", root=ROOT):
    """Run `names` in order; stop after a failed one (the parent starts a fresh worker for the rest)."""
    checks = _registry(registry)
    for name in names:
        _say("start", name)
        t0 = time.monotonic()
        status, fields = run_one(checks[name], until, root)
        _say("result", json.dumps({"check": name, "status": status, "seconds": time.monotonic() - t0,
                                   "fields": fields}))
        if status == "failed":
            return 3
    return 0


# ---- the parent: starts workers, enforces deadlines, writes records ---------------------------------
def _reader(stream, lines):
    for line in stream:
        lines.put(line)
    lines.put(None)


def run(names, env, folder, budget=BUDGET_S, registry="labkit.scripts.gpu_smoke:CHECKS", root=ROOT,
        echo=print, grace=GRACE_S, started=None):
    """Every check in `names` within `budget` seconds of `started` (time.time() of the command's start;
    default now), each result written to folder/<gpu>.jsonl.

    Returns [(check, status, seconds, fields)] in order. A worker that dies or overruns a check's deadline
    (its seconds plus `grace`) is killed: that check is recorded as failed with the end of the worker's
    output, and a fresh worker carries on with the next. Nothing runs past `started + budget - END_S`:
    the checks' own deadlines end `grace` seconds before that, and the last kill comes at it."""
    checks = _registry(registry)
    unknown = [n for n in names if n not in checks]
    if unknown:
        raise ValueError(f"names must be checks of {registry} ({', '.join(checks)}), got {unknown}")
    spent = 0.0 if started is None else max(0.0, time.time() - started)
    end = time.monotonic() - spent + budget - min(END_S, budget / 4)     # nothing runs past this
    until = end - min(grace, budget / 4)                                   # every check's own deadline
    todo, results = list(names), []

    def record(name, status, seconds, fields):
        write_record(folder, env, name, status, seconds, **fields)
        results.append((name, status, seconds, fields))
        echo(f"[gpu-smoke] {name}: {status} in {seconds:.1f} s" + _brief(fields))

    while todo:
        left = until - time.monotonic()
        if left < MIN_START_S:
            for name in todo:
                record(name, "skipped", 0.0, {"reason": f"out of time: {max(0.0, left):.0f} s of the {budget} s budget left"})
            break
        cmd = [sys.executable, "-m", "labkit.scripts.gpu_smoke", "--worker", ",".join(todo),
               "--until", repr(until), "--registry", registry]
        proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))})
        lines = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        tail = collections.deque(maxlen=60)
        current, started, deadline = None, time.monotonic(), end
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = "TIMEOUT"
            if line == "TIMEOUT" or line is None:
                exit_status = proc.poll() if line == "TIMEOUT" else proc.wait()
                _kill(proc)                            # the worker, or what it left running (pytest, children)
                name = current or todo[0]
                if line == "TIMEOUT":
                    why = f"killed: still running {time.monotonic() - started:.0f} s after it started " \
                          f"(its deadline: {checks[name].seconds} s + {grace} s, capped by the budget)"
                else:
                    why = f"the worker process died (exit {exit_status}) during this check"
                record(name, "failed", time.monotonic() - started, {"error": why, "output": "".join(tail)[-4000:]})
                todo.remove(name)
                break
            if line.startswith(MARK + "start "):
                current, started = line[len(MARK + "start "):].strip(), time.monotonic()
                deadline = min(end, started + checks[current].seconds + grace)
                tail.clear()
            elif line.startswith(MARK + "result "):
                res = json.loads(line[len(MARK + "result "):])
                record(res["check"], res["status"], res["seconds"], res["fields"])
                todo.remove(res["check"])
                current, deadline = None, end
                if res["status"] == "failed" or not todo:
                    proc.wait()
                    break
            else:
                tail.append(line)
                echo(line.rstrip("\n"))
    return results


def _kill(proc):
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)          # the worker and what it started (pytest, children)
    except ProcessLookupError:
        pass
    proc.wait()


def _brief(fields):
    if "error" in fields:
        return f": {str(fields['error']).splitlines()[0][:200]}"
    if "reason" in fields:
        return f": {fields['reason']}"
    shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()
             if isinstance(v, (int, float, str)) and not isinstance(v, bool)][:6]
    return (": " + ", ".join(shown)) if shown else ""


def summary(results):
    """The closing table, and the exit status: 1 if any check failed, else 0."""
    lines = ["", "gpu-smoke summary:"]
    for name, status, seconds, fields in results:
        lines.append(f"  {name:<30} {status:<8} {seconds:6.1f} s{_brief(fields)}")
    failed = [r[0] for r in results if r[1] == "failed"]
    lines.append(f"{len(results) - len(failed)} of {len(results)} checks ok or skipped"
                 + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return "\n".join(lines), 1 if failed else 0


# ---- measuring helpers ------------------------------------------------------------------------------
def gpu_time(fn, repeat=10, warmup=2):
    """Median seconds of fn() on the current CUDA stream, timed by CUDA events after `warmup` calls
    (without CUDA, by the wall clock: the tests' CPU runs)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def rel_err(x, ref):
    """max |x - ref| / max |ref|, in fp32 (one number per comparison: the worst element, scaled)."""
    return float((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def attention_flops(batch, heads, n, d, causal):
    """Forward FLOPs of attention: two N x N x d matmuls, 2 FLOPs per multiply-add (half the pairs if causal).
    Backward: 2.5 times as many (five matmuls against two), FlashAttention-2's convention."""
    fwd = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


# ---- the checks -------------------------------------------------------------------------------------
def check_test_gpu(ctx):
    """tests/test_gpu.py under pytest: its outcomes, and the figures its tests record (record_property)."""
    import xml.etree.ElementTree as ET
    test = ctx.root / "tests" / "test_gpu.py"
    if not test.exists():
        raise Skip(f"{test} is not here: run make gpu-smoke from a checkout")
    ctx.build.mkdir(parents=True, exist_ok=True)
    xml = ctx.build / "test_gpu.xml"
    xml.unlink(missing_ok=True)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test),
                          f"--junitxml={xml}", "-o", "junit_family=xunit1"], cwd=ctx.root, capture_output=True,
                         text=True, timeout=max(5, ctx.left() - 2))
    if not xml.exists():
        raise RuntimeError(f"pytest wrote no report (exit {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    figures = junit_figures(ET.parse(xml).getroot())
    if figures["failed"] or figures["errors"] or run.returncode not in (0, 5):
        figures["problems"] = [f"pytest exit {run.returncode}: {figures['failed']} failed, {figures['errors']} errors "
                               f"({figures.get('failed_tests', '')})", run.stdout[-1500:]]
    return figures


def junit_figures(root):
    """Counts and recorded properties from a pytest junit XML report (its root element)."""
    figures = dict(tests=0, passed=0, failed=0, errors=0, skipped=0)
    failed = []
    for case in root.iter("testcase"):
        figures["tests"] += 1
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[outcome]
        figures[key] += 1
        if outcome in ("failure", "error"):
            failed.append(case.get("name"))
        for prop in case.iter("property"):
            raw = prop.get("value")              # str() of what the test recorded
            if raw in ("True", "False"):
                value = raw == "True"
            else:
                try:
                    value = json.loads(raw)
                except (TypeError, ValueError):
                    value = raw
            figures[prop.get("name")] = value
    if failed:
        figures["failed_tests"] = ", ".join(failed)
    return figures


def check_allocator(ctx):
    """labkit.alloc against the real allocator: validate_allocator's rows, the children run side by side
    where the GPU holds them (each about 12 GiB at 4 layers)."""
    import torch
    from labkit.scripts import validate_allocator as va
    free, _ = torch.cuda.mem_get_info()
    jobs = max(1, min(len(va.SETTINGS), int(free // (16 * GiB))))
    rows = va.validate(layers=4, trace_file=ctx.root / "build" / "allocator_llama_trace.json", jobs=jobs,
                       timeout=max(30, ctx.left() - 20))
    ctx.build.mkdir(parents=True, exist_ok=True)
    (ctx.build / "allocator_validation.json").write_text(json.dumps(rows, indent=1))
    return allocator_figures(rows, jobs)


def allocator_figures(rows, jobs):
    """The record of validate_allocator's rows: how many agree exactly, the worst gap, each row in short."""
    gaps = [abs(r["model_peak_reserved"] - r["real_peak_reserved"]) / max(1, r["real_peak_reserved"]) for r in rows]
    return dict(rows=len(rows), rows_exact=sum(bool(r.get("exact")) for r in rows),
                worst_reserved_gap=max(gaps) if gaps else 0.0, children_at_once=jobs,
                mismatches=", ".join(f"{r['trace']}/{r['conf']}" for r in rows if not r.get("exact")) or "none",
                detail=[{k: r.get(k) for k in ("trace", "conf", "real_peak_reserved", "model_peak_reserved",
                                               "real_peak_allocated", "model_peak_allocated", "exact")} for r in rows])


def check_flash(ctx, shape=(4, 16, 4096, 128)):
    """labkit.flash's Triton kernels (backend="triton") against SDPA, bf16, B=4 H=16 N=4096 d=128, full and
    causal: the error of each against an fp32 reference (forward and the three gradients) and TFLOP/s
    forward and backward."""
    import torch
    import torch.nn.functional as F
    from labkit.flash import flash_attention
    B, H, N, D = shape
    figures = dict(batch=B, heads=H, n=N, head_dim=D, dtype="bf16")
    problems = []
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device=ctx.device, generator=g).bfloat16() for _ in range(4))
    block = 64                                   # notebook 08's TRITON_BLOCK at full size
    for causal in (False, True):
        tag = "causal" if causal else "full"

        def triton(a, b, c):
            return flash_attention(a, b, c, causal=causal, block_m=block, block_n=block, backend="triton")

        def sdpa(a, b, c):
            return F.scaled_dot_product_attention(a, b, c, is_causal=causal)   # Nq == Nk: both masks agree

        ref = _attention_grads(sdpa, q.float(), k.float(), v.float(), do.float())
        try:
            tri = _attention_grads(triton, q, k, v, do)
        except Exception as e:                   # triton's OutOfResources (shared memory) on a smaller GPU
            if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e).lower():
                raise
            block = 32
            tri = _attention_grads(triton, q, k, v, do)
        for part, t, s, r in zip(("out", "dq", "dk", "dv"), tri, _attention_grads(sdpa, q, k, v, do), ref):
            mine, theirs = rel_err(t, r), rel_err(s, r)
            figures[f"{tag}_{part}_err"], figures[f"{tag}_sdpa_{part}_err"] = mine, theirs
            if mine > 4 * theirs + 1e-3:
                problems.append(f"{tag} {part}: Triton error {mine:.2e} against SDPA's {theirs:.2e} "
                                f"(allowed: 4x SDPA's + 1e-3)")
        fwd_flops, bwd_flops = attention_flops(B, H, N, D, causal)
        for name, fn in (("triton", triton), ("sdpa", sdpa)):
            fwd_s, both_s = _fwd_and_fwd_bwd_time(fn, q, k, v, do)
            figures[f"{tag}_{name}_fwd_tflops"] = fwd_flops / fwd_s / 1e12
            figures[f"{tag}_{name}_bwd_tflops"] = bwd_flops / max(both_s - fwd_s, 1e-9) / 1e12
        figures[f"{tag}_fwd_ratio"] = figures[f"{tag}_triton_fwd_tflops"] / figures[f"{tag}_sdpa_fwd_tflops"]
    figures["block"] = block
    figures["problems"] = problems
    return figures


def _attention_grads(fn, q, k, v, do):
    """(out, dq, dk, dv) of fn(q, k, v) with output gradient do."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _fwd_and_fwd_bwd_time(fn, q, k, v, do):
    import torch
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def both():
        fn(q, k, v).backward(do)
        q.grad = k.grad = v.grad = None

    return gpu_time(forward), gpu_time(both, repeat=5)


def _fp32_precision(value):
    """Set fp32 matmuls to "ieee" (full fp32) or "tf32"; returns a function that restores the setting.

    One API only: torch.set_float32_matmul_precision ("highest" / "high"), the one notebook 12 uses. Once
    the newer torch.backends.cuda.matmul.fp32_precision has been set, reading the legacy setting (as
    cuBLASLt's paths do: a linear with bias, a batched matmul) raises "mix of the legacy and new APIs";
    set_float32_matmul_precision keeps both readable."""
    import torch
    if value not in ("ieee", "tf32"):
        raise ValueError(f"value must be 'ieee' or 'tf32', got {value!r}")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest" if value == "ieee" else "high")
    return lambda: torch.set_float32_matmul_precision(before)


def check_tf32(ctx, n=8192):
    """fp32 matmuls (8192 x 8192 x 8192) with TF32 off (ieee) and on: TFLOP/s and the error against fp64
    (on the first 1024 rows); bf16 at the same size beside them."""
    import torch
    g = torch.Generator(device=ctx.device).manual_seed(0)
    a, b = torch.randn(n, n, device=ctx.device, generator=g), torch.randn(n, n, device=ctx.device, generator=g)
    ref = a[:1024].double() @ b.double()
    figures = dict(n=n)
    for precision in ("ieee", "tf32"):
        restore = _fp32_precision(precision)
        try:
            figures[f"{precision}_tflops"] = 2 * n**3 / gpu_time(lambda: a @ b, repeat=5) / 1e12
            figures[f"{precision}_err"] = rel_err((a[:1024] @ b).double(), ref)
        finally:
            restore()
    a16, b16 = a.bfloat16(), b.bfloat16()
    figures["bf16_tflops"] = 2 * n**3 / gpu_time(lambda: a16 @ b16, repeat=5) / 1e12
    figures["tf32_speedup_ratio"] = figures["tf32_tflops"] / figures["ieee_tflops"]
    problems = []
    if figures["ieee_err"] > 1e-4:
        problems.append(f"fp32 with TF32 off has error {figures['ieee_err']:.2e}: TF32 was not off")
    figures["problems"] = problems
    return figures


def check_matmul(ctx, n=4096):
    """labkit.kernels.matmul (Triton, notebook 12's tiles) against cuBLAS, 4096^3 bf16 and fp32: TFLOP/s,
    and the Triton kernel's fp32 error with precision "ieee" and "tf32" against fp64."""
    import torch
    from labkit import kernels
    tiles = dict(block_m=128, block_n=128, group_m=8, num_warps=8, num_stages=3)   # notebook 12's TILES
    g = torch.Generator(device=ctx.device).manual_seed(0)
    a, b = torch.randn(n, n, device=ctx.device, generator=g), torch.randn(n, n, device=ctx.device, generator=g)
    a16, b16 = a.bfloat16(), b.bfloat16()
    flops = 2 * n**3
    figures = dict(n=n, tiles=json.dumps(tiles))
    figures["triton_bf16_tflops"] = flops / gpu_time(lambda: kernels.matmul(a16, b16, **tiles)) / 1e12
    figures["cublas_bf16_tflops"] = flops / gpu_time(lambda: a16 @ b16) / 1e12
    figures["bf16_ratio"] = figures["triton_bf16_tflops"] / figures["cublas_bf16_tflops"]
    ref = a[:512].double() @ b.double()
    for precision in ("ieee", "tf32"):
        figures[f"triton_fp32_{precision}_tflops"] = flops / gpu_time(
            lambda: kernels.matmul(a, b, precision=precision, **tiles), repeat=5) / 1e12
        figures[f"triton_fp32_{precision}_err"] = rel_err(kernels.matmul(a, b, precision=precision, **tiles)[:512].double(), ref)
    restore = _fp32_precision("ieee")
    try:
        figures["cublas_fp32_ieee_tflops"] = flops / gpu_time(lambda: a @ b, repeat=5) / 1e12
    finally:
        restore()
    figures["triton_bf16_err"] = rel_err(kernels.matmul(a16, b16, **tiles)[:512].double(), ref)
    problems = []
    if figures["triton_fp32_ieee_err"] > 1e-4:
        problems.append(f"Triton fp32 with precision='ieee' has error {figures['triton_fp32_ieee_err']:.2e}")
    figures["problems"] = problems
    return figures


def check_cuda_graphs(ctx):
    """A launch-bound forward (24 Linear(512, 512) + GELU at batch 8) eager and as a raw torch.cuda.CUDAGraph
    (no torch.compile, no decoder: not notebook 11's compiled-against-graphed decoder): time per call, and
    the graph's private memory pool: reserved by the capture, kept through empty_cache while the graph
    lives, returned once it is deleted."""
    import torch
    layers = [m for _ in range(24) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers).cuda().eval()
    x = torch.randn(8, 512, device="cuda")
    figures = {}
    with torch.no_grad():
        figures["eager_s"] = gpu_time(lambda: model(x), repeat=20)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                 # warm-up on a side stream, as torch.cuda.graphs asks
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved0, allocated0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = model(x)
        torch.cuda.synchronize()
        figures["pool_reserved_bytes"] = torch.cuda.memory_reserved() - reserved0
        figures["output_held_bytes"] = torch.cuda.memory_allocated() - allocated0
        figures["graph_s"] = gpu_time(graph.replay, repeat=20)
        x.copy_(torch.randn(8, 512, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(y, model(x))
        torch.cuda.empty_cache()
        figures["pool_kept_bytes"] = torch.cuda.memory_reserved() - reserved0
        del graph, y
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        figures["pool_after_delete_bytes"] = torch.cuda.memory_reserved() - reserved0
    figures["speedup_ratio"] = figures["eager_s"] / figures["graph_s"]
    figures["replay_err"] = err
    figures["problems"] = [f"the graph's replay differs from eager by {err:.2e}"] if err > 1e-5 else []
    return figures


def check_bandwidth(ctx):
    """Copies of 1 GiB between the GPU and pinned or pageable host memory, both ways (labkit.offload.bandwidth)."""
    from labkit import offload
    figures = {}
    for route, key in (("pinned->device", "pinned_h2d"), ("pageable->device", "pageable_h2d"),
                       ("device->pinned", "pinned_d2h"), ("device->pageable", "pageable_d2h")):
        figures[f"{key}_gbps"] = offload.bandwidth(route, "1 GiB", repeat=3) / 1e9
    figures["pinned_h2d_ratio"] = figures["pinned_h2d_gbps"] / figures["pageable_h2d_gbps"]
    figures["pinned_d2h_ratio"] = figures["pinned_d2h_gbps"] / figures["pageable_d2h_gbps"]
    return figures


def check_overlap(ctx):
    """Notebook 04's side-stream overlap: a 512 MiB copy to pinned memory and 20 fp32 4096 matmuls, one
    after the other and overlapped (the copy on a side stream); the time hidden, against notebook 04's
    assert (hidden > half the shorter of the two)."""
    import torch
    a = torch.randn(4096, 4096, device="cuda")
    src = torch.randn(128 * 2**20, device="cuda")
    dst = torch.empty(src.shape, pin_memory=True)
    side = torch.cuda.Stream()

    def compute():
        for _ in range(20):
            a @ a

    def copy_then_compute():
        dst.copy_(src, non_blocking=True)
        compute()

    def overlapped():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        compute()
        torch.cuda.current_stream().wait_stream(side)

    t = {name: gpu_time(fn, repeat=5) for name, fn in (("copy", lambda: dst.copy_(src, non_blocking=True)),
                                                        ("compute", compute), ("serial", copy_then_compute),
                                                        ("overlapped", overlapped))}
    hidden = t["serial"] - t["overlapped"]
    return dict(copy_s=t["copy"], compute_s=t["compute"], serial_s=t["serial"], overlapped_s=t["overlapped"],
                hidden_s=hidden, hidden_share=hidden / min(t["copy"], t["compute"]),
                notebook_04_assert_holds=bool(hidden > 0.5 * min(t["copy"], t["compute"])))


def check_bnb_4bit(ctx):
    """bitsandbytes NF4 against bf16 at batch 1: a Llama-7B MLP's up projection (4096 -> 11008), time per
    call, weight bytes on the GPU, error."""
    import torch
    import bitsandbytes as bnb
    torch.manual_seed(0)
    dense = torch.nn.Linear(4096, 11008, bias=False, dtype=torch.bfloat16)
    before = torch.cuda.memory_allocated()
    nf4 = bnb.nn.Linear4bit(4096, 11008, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    nf4.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type="nf4")
    nf4 = nf4.cuda()                                     # quantized as it moves to the GPU
    nf4_bytes = torch.cuda.memory_allocated() - before
    dense = dense.cuda()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        figures = dict(bf16_s=gpu_time(lambda: dense(x), repeat=50), nf4_s=gpu_time(lambda: nf4(x), repeat=50),
                       bf16_weight_bytes=dense.weight.numel() * 2, nf4_weight_bytes=nf4_bytes,
                       nf4_err=rel_err(nf4(x), dense(x)), bitsandbytes=bnb.__version__)
    figures["nf4_speed_ratio"] = figures["bf16_s"] / figures["nf4_s"]
    return figures


# ---- each notebook's full-size steps ------------------------------------------------------------------
class NoPlan(Skip):
    """The notebook's parameters cell lacks FULL_STEPS, or it is malformed."""


def full_steps(notebook):
    """FULL_STEPS of the notebook's parameters cell, executed here (set LABKIT_SIZE=full first).

    Shared with tests/test_full_size.py. Each step must fit labkit.device.CARD * (1 - HEADROOM): the headroom
    is labkit's, not the notebook's. Raises NoPlan where the plan is missing or malformed; whatever the cell
    raises itself propagates."""
    import torch
    from labkit.device import HEADROOM
    source = parameters_source(notebook)
    if any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()):
        raise NoPlan("its parameters cell uses IPython magics (% or !): keep it plain Python")
    threads, env, cwd = torch.get_num_threads(), {"__name__": "__main__"}, os.getcwd()
    try:
        os.chdir(pathlib.Path(notebook).parent)              # where nbval runs the notebook
        with ipython_stand_in():
            exec(compile(source, f"{notebook} [parameters]", "exec"), env)
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)       # parameters cells set one thread: that is for their notebook
    if "FULL_STEPS" not in env:
        raise NoPlan("its parameters cell does not define FULL_STEPS (contract 1: FULL_STEPS = "
                     "{step: lk.estimate keywords or dict(bytes=...)})")
    if "HEADROOM" in env and env["HEADROOM"] != HEADROOM:
        raise NoPlan(f"its parameters cell sets HEADROOM = {env['HEADROOM']!r}: the headroom is labkit's "
                     f"(lk.HEADROOM = {HEADROOM}), the same for every notebook")
    steps = env["FULL_STEPS"]
    if not isinstance(steps, dict) or not steps:
        raise NoPlan(f"FULL_STEPS must be a non-empty dict of step name -> keywords, got {steps!r}")
    return steps


class ipython_stand_in:
    """Within the block, `import IPython.display` works where IPython is not installed (the GPU image has
    none): a parameters cell's `from IPython.display import display` gets a display() that prints. Where
    IPython is installed, nothing changes. The stand-in modules are removed again on exit."""

    def __enter__(self):
        import types
        self.added = []
        if importlib.util.find_spec("IPython") is not None:
            return self
        ipython, display = types.ModuleType("IPython"), types.ModuleType("IPython.display")

        def show(*objs, **kw):
            for obj in objs:
                print(obj)
        display.display = show
        def anything(name):
            """Markdown(text), HTML(text), ...: the text itself, which display() then prints. Dunder names
            stay missing, as on any module (inspect reads __file__ of every module in sys.modules)."""
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *args, **kw: args[0] if args else ""
        display.__getattr__ = anything
        ipython.display = display
        for name, module in (("IPython", ipython), ("IPython.display", display)):
            sys.modules[name] = module
            self.added.append(name)
        return self

    def __exit__(self, *exc):
        for name in self.added:
            sys.modules.pop(name, None)
        return False


def parameters_source(notebook):
    """The source of the notebook's parameters cell (its first code cell, tagged `parameters`)."""
    nb = json.loads(pathlib.Path(notebook).read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    if not code or "parameters" not in code[0].get("metadata", {}).get("tags", []):
        raise NoPlan("its first code cell is not tagged `parameters`")
    src = code[0]["source"]
    return "".join(src) if isinstance(src, list) else src


PLAIN = {"config", "batch", "seq", "dtype", "optimizer", "training", "recompute", "foreach", "device"}


def how(kw):
    """How gpu-smoke runs this FULL_STEPS entry: ("plain", "") as a plain training loop's step
    (labkit.estimate.step.plain_step, the step lk.estimate measures), ("verify", "") with its levers
    (labkit.plan.verify.measure: fused step, chunked loss, accumulation, mixed precision, ...), or
    (None, why not). The entry is read by labkit.estimate.full_step, as tests/test_full_size.py reads it."""
    from labkit.estimate import full_step
    step = full_step(kw)
    if step["bytes"] is not None:
        return None, "a step given by its bytes (no model to run)"
    kw = step["estimate"]
    if kw.get("training", True) is False:
        return None, "an inference step (gpu-smoke runs training steps)"
    extra = sorted(set(kw) - PLAIN)
    why = (f"keywords gpu-smoke does not run: {', '.join(extra)}" if extra
           else f"dtype {kw.get('dtype')!r}" if kw.get("dtype", "bf16") not in ("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16")
           else f"optimizer {kw.get('optimizer')!r}" if kw.get("optimizer", "adamw") not in ("sgd", "sgd-momentum", "adam", "adamw", None)
           else f"recompute={kw.get('recompute')!r} (only True or False)" if kw.get("recompute", False) not in (False, True)
           else "")
    if not why:
        return "plain", ""
    beyond_plain = step["levers"] or kw.get("dtype") == "mixed" or str(kw.get("optimizer")).startswith(("adamw-8bit", "paged-"))
    if beyond_plain and step["verify"] is not None:
        return "verify", ""
    return None, why


def runnable(kw):
    """Why gpu-smoke cannot run this FULL_STEPS entry ('' if it can)."""
    return how(kw)[1]


def run_step(kw, device="cuda"):
    """One FULL_STEPS entry run for real on the GPU: its peak tracked against the estimate. Figures.

    A plain step: two tracked steps, then a third timed. A step with levers: labkit.plan.verify.measure's
    step, one tracked (its optimizer state made before it). What the entry says stays alive beside the step
    (`beside`) is counted in the estimate and in check_notebook's cap, not allocated here.
    device="cpu" runs the same code without the allocator's figures (tests, at tiny size)."""
    import torch
    import labkit as lk
    from labkit.estimate import full_step, load_config
    from labkit.estimate.config import build_model
    from labkit.estimate.step import plain_step, quiet
    kind, why = how(kw)
    if kind is None:
        raise Skip(why)
    step_kw = full_step(kw)
    kw, beside = step_kw["estimate"], sum(step_kw["beside"].values())
    est = lk.estimate(**{**kw, "device": "cuda"})
    config = load_config(kw["config"])
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracked, allocated, step_s = 0, None, None
    if kind == "verify":
        from labkit.plan.verify import measure
        lv = step_kw["verify"]
        parts = measure(config, "finetune", lv, kw.get("seq", 512), batch=lv["micro_batch"] * lv["grad_accum"],
                        device=device)[0]
        tracked = sum(parts.values())
    else:
        dtype = kw.get("dtype", "bf16")
        weights = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        model = build_model(config, device, weights)
        ids = torch.randint(0, config.vocab_size, (kw.get("batch", 1), kw.get("seq", 512)), device=device)
        step, objs = plain_step(model, config, ids, dtype, kw.get("optimizer", "adamw"), kw.get("recompute", False),
                                kw.get("foreach", False))
        with quiet():
            for _ in range(2):                  # the first step creates the optimizer state, the second is steady
                with lk.track(*objs, device=device) as mem:
                    step()
                tracked = max(tracked, mem.peak)
                if cuda:
                    allocated = max(allocated or 0, mem.cuda["peak_allocated"] - mem.cuda["allocated_start"] + mem.start)
            if cuda:
                step_s = gpu_time(step, repeat=1, warmup=0)
            else:
                t0 = time.perf_counter()
                step()
                step_s = time.perf_counter() - t0
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    if cuda and kind == "verify":
        allocated = torch.cuda.max_memory_allocated()
    return dict(how=kind, estimated_bytes=int(est.total) + beside, tracked_bytes=int(tracked) + beside,
                beside_bytes=beside, allocated_bytes=allocated, reserved_bytes=reserved,
                estimate_gap=(tracked + beside) / (est.total + beside) - 1, step_s=step_s)


class card:
    """Within the block, this process's CUDA caching allocator may hold at most `limit` bytes (a memory
    fraction, as lk.budget sets): a card of that size, on a larger GPU."""

    def __init__(self, limit):
        self.limit = limit

    def __enter__(self):
        import torch
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        self.before = torch.cuda.get_per_process_memory_fraction()    # a fence around the run stays (1.0: none)
        torch.cuda.set_per_process_memory_fraction(min(self.before, self.limit / total))
        return self

    def __exit__(self, *exc):
        import torch
        torch.cuda.set_per_process_memory_fraction(self.before)
        return False


def check_notebook(stem):
    """The check of one notebook: its largest runnable FULL_STEPS entry (then the others while time remains)
    run for real under a memory cap of lk.CARD * (1 - lk.HEADROOM) (a per-process memory fraction, so the
    caching allocator behaves as on the workshop card: it frees its cache and retries before it gives up); the
    record says whether each step ran within the cap, and its peaks against the estimate."""
    def check(ctx):
        import torch
        import labkit as lk
        from labkit.estimate import full_step
        path = ctx.root / "notebooks" / f"{stem}.ipynb"
        if not path.exists():
            raise Skip(f"{path} is not here: run make gpu-smoke from a checkout")
        os.environ["LABKIT_SIZE"] = "full"
        try:
            steps = full_steps(path)
        except NoPlan as e:
            raise Skip(f"{stem}: {e}") from None
        why = {name: runnable(kw) for name, kw in steps.items()}
        todo = [name for name, reason in why.items() if not reason]
        if not todo:
            raise Skip(f"{stem}: no FULL_STEPS entry gpu-smoke can run (" +
                       "; ".join(f"{n}: {r}" for n, r in why.items()) + ")")
        read = {n: full_step(steps[n]) for n in todo}
        beside = {n: sum(read[n]["beside"].values()) for n in todo}
        estimated = {n: lk.estimate(**{**read[n]["estimate"], "device": "cuda"}).total + beside[n] for n in todo}
        todo.sort(key=lambda n: -estimated[n])
        limit = lk.LIMIT
        ran, problems = {}, []
        for name in todo:
            if ran and ctx.left() < 20:
                break
            try:
                with card(limit - beside[name]):         # what stays alive beside the step takes its share
                    ran[name] = run_step(steps[name])
                ran[name]["fits_24gib"] = True
            except torch.OutOfMemoryError as e:
                ran[name] = dict(estimated_bytes=int(estimated[name]), fits_24gib=False, oom=str(e)[:500])
                kept = f", less {beside[name] / GiB:.1f} GiB kept beside it" if beside[name] else ""
                problems.append(f"step {name!r} ran out of memory under the {(limit - beside[name]) / GiB:.1f} GiB cap "
                                f"({lk.CARD / GiB:.0f} GiB with HEADROOM {lk.HEADROOM:g} left free{kept}); estimated "
                                f"{estimated[name] / GiB:.1f} GiB")
            finally:
                lk.free()                        # the step's model and optimizer are gone: return their memory
        largest = todo[0]
        return dict(step=largest, **ran[largest], limit_bytes=int(limit), headroom=lk.HEADROOM,
                    steps_run=len(ran), steps_not_run=", ".join(f"{n} ({r})" for n, r in why.items() if r) or "none",
                    all_steps=ran, gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
                    problems=problems)
    check.__name__ = f"check_{stem}"
    check.__doc__ = f"Notebook {stem}'s full-size steps run on the GPU."
    return check


def _notebook_checks():
    from labkit.records import GPU_CHECKS
    return [Check(name, check_notebook(name), 60, ("transformers",))
            for name in GPU_CHECKS if re.fullmatch(r"[0-9]{2}_[a-z0-9_]+", name)]


# name, function, seconds at most (its deadline), packages it needs: most valuable first.
CHECKS = [
    Check("test_gpu", check_test_gpu, 75, ("pytest", "transformers")),
    Check("allocator", check_allocator, 120, ("transformers",)),
    Check("flash", check_flash, 60, ("triton",)),
    Check("tf32", check_tf32, 20, ()),
    Check("matmul", check_matmul, 40, ("triton",)),
    Check("cuda_graphs", check_cuda_graphs, 20, ()),
    Check("bandwidth", check_bandwidth, 20, ()),
    Check("overlap", check_overlap, 20, ()),
    Check("bnb_4bit", check_bnb_4bit, 30, ("bitsandbytes",)),
] + _notebook_checks()


def cuda_env():
    """{"gpu", "torch", "cuda"} of this machine, or None where torch sees no CUDA GPU."""
    import torch
    if not torch.cuda.is_available():
        return None
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for the whole command, from --started (default {BUDGET_S})")
    p.add_argument("--started", type=float, default=None, metavar="EPOCH",
                   help="when the command started (date +%%s; make gpu-smoke passes it): the budget counts from "
                        "there (default: when this script started)")
    p.add_argument("--only", default="", help="comma-separated check names (default: all, in order)")
    p.add_argument("--out", default=None, help="folder of the records (default: labkit.records.GPU_DIR, data/gpu)")
    p.add_argument("--list", action="store_true", help="list the checks and exit")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--registry", default="labkit.scripts.gpu_smoke:CHECKS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker.split(","), args.until, args.registry)
    from labkit.records import GPU_CHECKS, GPU_DIR, unwritable
    if args.list:
        for c in CHECKS:
            print(f"{c.name:<30} {c.seconds:4d} s  {GPU_CHECKS[c.name]}"
                  + (f"  (needs {', '.join(c.needs)})" if c.needs else ""))
        return 0
    # Arguments first, before CUDA is even asked about: a typo costs nothing, not a GPU run.
    if not math.isfinite(args.budget) or args.budget <= 0:
        p.error(f"--budget must be a positive number of seconds, got {args.budget!r}")
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if args.only.strip() and not names:
        p.error(f"--only must name checks (comma-separated, see --list), got {args.only!r}")
    known = [c.name for c in CHECKS]
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"--only names unknown checks {unknown}; --list shows them: {', '.join(known)}")
    names = names or known
    folder = pathlib.Path(args.out) if args.out else GPU_DIR
    problem = unwritable(folder)
    if problem:
        p.error(f"--out {folder}: {problem}")
    env = cuda_env()
    if env is None:
        import torch
        print(f"gpu-smoke needs a CUDA GPU, and torch {torch.__version__} sees none here (CUDA build: "
              f"{torch.version.cuda or 'none'}). Nothing was measured or written. On a CPU, `make test` "
              f"runs the tiny size.", file=sys.stderr)
        return 2
    started = STARTED if args.started is None else args.started
    print(f"gpu-smoke on {env['gpu']} (torch {env['torch']}, CUDA {env['cuda']}): {len(names)} checks within "
          f"{args.budget:.0f} s of the command's start ({time.time() - started:.0f} s ago), records appended to "
          f"{folder / gpu_file_name(env['gpu'])}", flush=True)
    results = run(names, env, folder, budget=args.budget, started=started)
    text, status = summary(results)
    print(text, flush=True)
    return status


if __name__ == "__main__":
    # Run as the imported module, not as __main__: the worker looks checks up by module path, and their
    # Skip must be this module's Skip.
    from labkit.scripts.gpu_smoke import main as _main
    sys.exit(_main())
