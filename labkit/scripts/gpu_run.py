"""`make test-gpu`: every notebook at full size and tests/test_gpu.py on one CUDA GPU, within one window.

    python -m labkit.scripts.gpu_run [--notebooks 03 05 | todo] [--workers N] [--budget 540] [--fence 21.6GiB]

The notebooks run in parallel workers on the one GPU, each under nbval (`pytest --nbval-lax`, the
repository's conftest failing a cell that writes to stderr) in a kernel of its own whose CUDA caching
allocator is fenced to what the workshop card leaves a notebook (FENCE_BYTES: lk.CARD * (1 - lk.HEADROOM) =
21.6 GiB, the limit tests/test_full_size.py holds every FULL_STEPS entry to; labkit/scripts/gpu_fence.py sets
a per-process memory fraction before the first cell). So on a larger GPU each notebook still proves the
workbook's promise: every step it runs fits a 24 GB card.
Workers: as many as the GPU's memory holds (a fence and 2 GiB beside it for the CUDA context and what
the notebook's own subprocesses take) and the CPU cores allow (3 each: the kernel, compile workers, gloo
ranks), longest notebook first (by its last time on this GPU in data/gpu/, else its metadata's
minutes_full) onto whichever worker is free.

Each notebook's result goes to data/gpu/<gpu>.jsonl as it ends (check "test-gpu:<notebook>"): status,
seconds, the kernel's peak reserved and allocated bytes, the fence, the cells that failed and the
notebook's hash, so a run cut short (--budget: the whole command's seconds) is completed later by
`make test-gpu NOTEBOOKS="..."` or `NOTEBOOKS=todo` (every notebook this GPU has not passed in its
present form), and `make workbook`'s page shows which notebooks a GPU has passed. Logs in build/gpu/.
Exit 0 if every notebook run passed and none was left out, else 1; 2 without CUDA.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

from labkit.device import LIMIT

ROOT = pathlib.Path(__file__).resolve().parents[2]
GiB = 2**30
FENCE_BYTES = LIMIT   # 21.6 GiB: what every notebook step promises to fit
BESIDE_BYTES = 2 * GiB          # per worker beyond its fence: the context, a notebook's own subprocesses
KEEP_FREE_BYTES = 4 * GiB       # of the GPU, left to no worker
CORES_PER_WORKER = 3
BUDGET_S = 540                  # the command's seconds: a 10-minute window less the wheels' install
STARTUP_MIN = 0.3               # per job, beyond its metadata's minutes: pytest, a kernel, imports, a CUDA context
PLAN_GPU_BYTES, PLAN_CORES = 79 * GiB, 16   # --plan on a CPU: an H100's 80 GB (79 GiB free) and 16 cores
TEST_GPU = "test_gpu"           # tests/test_gpu.py, run as one more job
PREFIX = "test-gpu:"            # the records' check names: "test-gpu:03_activation_checkpointing"

Job = collections.namedtuple("Job", "name path minutes")


def notebooks(folder=ROOT / "notebooks"):
    return sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb"))


def digest(path):
    """The first 12 hex digits of the file's sha256: which version of a notebook a record is about."""
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:12]


def passed(records, gpu):
    """{job name: notebook hash} of every job this GPU has passed, from its records (latest wins)."""
    out = {}
    for rec in sorted(records, key=lambda r: r["date"]):
        if rec.get("gpu") == gpu and rec["check"].startswith(PREFIX):
            name = rec["check"][len(PREFIX):]
            if rec.get("status") == "ok":
                out[name] = rec.get("notebook_sha")
            else:
                out.pop(name, None)
    return out


def estimated_minutes(path, records=(), gpu=None):
    """A job's minutes: its last time on this GPU (records), else the notebook's metadata (minutes_full) and
    STARTUP_MIN."""
    name = path.stem
    times = [r["seconds"] / 60 for r in sorted(records, key=lambda r: r["date"])
             if r.get("gpu") == gpu and r["check"] == PREFIX + name and r.get("status") in ("ok", "failed")]
    if times:
        return round(times[-1], 2)
    if path.suffix == ".ipynb":
        return float(json.loads(path.read_text())["metadata"]["labkit"]["minutes_full"]) + STARTUP_MIN
    return 0.5 + STARTUP_MIN                    # tests/test_gpu.py: four tests of seconds each


def select(names, records=(), gpu=None, folder=ROOT / "notebooks"):
    """The jobs, longest first: every notebook and tests/test_gpu.py; or those named (numbers like "05",
    names, "test_gpu"); or "todo": those this GPU has not passed in their present form."""
    paths = {p.stem: p for p in notebooks(folder)}
    paths[TEST_GPU] = ROOT / "tests" / "test_gpu.py"
    if not names:
        chosen = list(paths)
    elif list(names) == ["todo"]:
        done = passed(records, gpu)
        chosen = [n for n, p in paths.items() if n not in done or done[n] != digest(p)]
    else:
        chosen = []
        for name in names:
            match = [n for n in paths if n == name or n[:2] == str(name).zfill(2)]
            if not match:
                raise ValueError(f"notebooks: {name!r} names no notebook; there are "
                                 f"{', '.join(n[:2] for n in paths if n != TEST_GPU)}, {TEST_GPU} and todo")
            chosen += [n for n in match if n not in chosen]
    jobs = [Job(n, paths[n], estimated_minutes(paths[n], records, gpu)) for n in chosen]
    return sorted(jobs, key=lambda j: -j.minutes)


def workers_for(gpu_free_bytes, cores, jobs, fence=FENCE_BYTES):
    """How many jobs run at once: what the GPU's free memory holds, the cores allow, and the jobs need."""
    by_memory = int((gpu_free_bytes - KEEP_FREE_BYTES) // (fence + BESIDE_BYTES))
    return max(1, min(by_memory, max(1, cores // CORES_PER_WORKER), jobs))


def layout(jobs, workers):
    """The planned schedule: [[job names] per worker], longest first onto the least-loaded worker, and
    each worker's estimated minutes (the run hands out jobs as workers free up: the same order)."""
    plan, load = [[] for _ in range(workers)], [0.0] * workers
    for job in jobs:
        w = load.index(min(load))
        plan[w].append(job.name)
        load[w] += job.minutes
    return plan, load


def ipython_dir(build, fence_file):
    """An IPython profile whose kernels run gpu_fence.py first (exec_lines, in a namespace of their own)."""
    folder = pathlib.Path(build) / "ipython"
    (folder / "profile_default").mkdir(parents=True, exist_ok=True)
    (folder / "profile_default" / "ipython_kernel_config.py").write_text(
        "# Written by labkit/scripts/gpu_run.py: each kernel fenced before its first cell.\n"
        f"c.IPKernelApp.exec_lines = [\"exec(open({str(fence_file)!r}).read(), {{'__name__': 'labkit_gpu_fence'}})\"]\n")
    return folder


def command(job, cell_timeout, xml):
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
            f"--junitxml={xml}"]
    if job.name == TEST_GPU:
        return [*base, str(job.path)]
    return [*base, "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={int(cell_timeout)}", str(job.path)]


def outcome(xml, returncode):
    """(status, fields) of a finished job from its junit report."""
    fields = dict(cells=0, cells_failed=0)
    failed = []
    if pathlib.Path(xml).exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            fields["cells"] += 1
            bad = next((c for c in case if c.tag in ("failure", "error")), None)
            if bad is not None:
                fields["cells_failed"] += 1
                first = (bad.get("message") or bad.text or "").strip().splitlines()
                failed.append(f"{case.get('name')}: {first[0][:200] if first else bad.tag}")
    if failed:
        fields["failed"] = "; ".join(failed)[:2000]
    ok = returncode == 0 and not failed and fields["cells"] > 0
    if not ok and not failed:
        fields["error"] = f"pytest exit {returncode} with no failed cell in its report (see the log)"
    return ("ok" if ok else "failed"), fields


def run(jobs, env, folder, workers, budget=BUDGET_S, fence=FENCE_BYTES, started=None, build=ROOT / "build" / "gpu",
        cores=None, echo=print, command=command):
    """Every job within `budget` seconds of `started` (time.time(); default now), `workers` at a time;
    each result written to folder/<gpu>.jsonl as it ends. Returns ([(name, status, seconds, fields)] in
    the order they ended, jobs cut at the deadline included as "skipped"; the names never started).
    `command(job, seconds left, junit xml path)`: the process of one job (tests give toy ones)."""
    from labkit.scripts.gpu_smoke import write_record
    started = time.time() if started is None else started
    end = started + budget
    build = pathlib.Path(build)
    (build / "logs").mkdir(parents=True, exist_ok=True)
    profile = ipython_dir(build, ROOT / "labkit" / "scripts" / "gpu_fence.py")
    threads = str(max(1, (cores or os.cpu_count() or 1) // workers))
    base_env = {**os.environ, "LABKIT_SIZE": "full", "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": threads, "IPYTHONDIR": str(profile),
                "LABKIT_GPU_FENCE": str(int(fence)),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    todo, running, results = list(jobs), {}, []

    def finish(name, status, seconds, fields):
        job = next(j for j in jobs if j.name == name)
        fields = {"notebook": name, "minutes_estimated": job.minutes, "workers": workers,
                  "notebook_sha": digest(job.path), **fields}
        write_record(folder, env, PREFIX + name, status, seconds, **fields)
        results.append((name, status, seconds, fields))
        echo(f"[test-gpu] {name}: {status} in {seconds / 60:.1f} min" + _brief(fields))

    while todo or running:
        while todo and len(running) < workers and end - time.time() > 30:
            job = todo.pop(0)
            xml, peak, log = (build / f"{job.name}.{kind}" for kind in ("xml", "peak.json", "log"))
            for f in (xml, peak):
                f.unlink(missing_ok=True)
            out = open(build / "logs" / log.name, "w")
            proc = subprocess.Popen(command(job, end - time.time(), xml), cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, env={**base_env, "LABKIT_GPU_PEAK_FILE": str(peak)},
                                    start_new_session=True)
            running[job.name] = (proc, time.time(), xml, peak, out)
            echo(f"[test-gpu] {job.name}: started ({job.minutes:.1f} min estimated; {len(running)} running)")
        if not running:
            break                                               # the rest would start too close to the end
        time.sleep(1)
        for name, (proc, t0, xml, peak, out) in list(running.items()):
            late = time.time() >= end
            if proc.poll() is None and not late:
                continue
            if late and proc.poll() is None:
                _kill(proc)
            out.close()
            del running[name]
            memory = json.loads(peak.read_text()) if peak.exists() else {}
            if late:
                finish(name, "skipped", time.time() - t0, {"reason": f"cut at the run's deadline ({budget:.0f} s): "
                                                                      f"make test-gpu NOTEBOOKS={name[:2]}", **memory})
            else:
                status, fields = outcome(xml, proc.returncode)
                finish(name, status, time.time() - t0, {**fields, **memory})
    return results, [j.name for j in todo]


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)          # pytest, its kernel, and what the notebook started
    except ProcessLookupError:
        pass
    proc.wait()


def _brief(fields):
    shown = [f"peak reserved {fields['peak_reserved_bytes'] / GiB:.1f} GiB of {fields['fence_bytes'] / GiB:.0f}"]\
        if "peak_reserved_bytes" in fields else []
    for key in ("failed", "error", "reason"):
        if key in fields:
            shown.append(str(fields[key]).splitlines()[0][:200])
    return (": " + "; ".join(shown)) if shown else ""


def summary(results, not_started, all_names, records, gpu):
    """The closing lines and the exit status (0: every notebook run passed and none was left out)."""
    lines = ["", "test-gpu summary:"]
    for name, status, seconds, fields in sorted(results):
        lines.append(f"  {name:<38} {status:<8} {seconds / 60:5.1f} min{_brief(fields)}")
    done = passed(records, gpu)
    paths = {p.stem: p for p in notebooks()}
    missing = [n for n in all_names if n not in done or (n in paths and done[n] != digest(paths[n]))]
    if not_started:
        lines.append(f"not started (out of time): {', '.join(not_started)}")
    if missing:
        numbers = " ".join(n[:2] if n[:2].isdigit() else n for n in missing)
        lines.append(f"not passed on this GPU yet: {', '.join(missing)}. To finish: make test-gpu NOTEBOOKS=\"{numbers}\" "
                     f"(or NOTEBOOKS=todo)")
    else:
        lines.append(f"every notebook and {TEST_GPU} has passed on this GPU in its present form")
    failed = [r for r in results if r[1] != "ok"]
    return "\n".join(lines), 1 if failed or not_started else 0


def parse_bytes_arg(text):
    match = re.fullmatch(r"\s*([0-9.]+)\s*(GiB|GB|MiB)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"--fence must be a size like 21.6GiB, got {text!r}")
    return int(float(match.group(1)) * {"GiB": GiB, "GB": 10**9, "MiB": 2**20, None: 1}[match.group(2)])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--notebooks", nargs="*", default=None, metavar="NN",
                   help="numbers or names (and test_gpu), or todo: what this GPU has not passed (default: all)")
    p.add_argument("--workers", type=int, default=None, help="jobs at once (default: what memory and cores allow)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds from --started (default {BUDGET_S})")
    p.add_argument("--started", type=float, default=None, metavar="EPOCH", help="the command's start (date +%%s)")
    p.add_argument("--fence", type=parse_bytes_arg, default=FENCE_BYTES, help=f"each kernel's memory (default {FENCE_BYTES / GiB:.1f}GiB)")
    p.add_argument("--cores", type=int, default=None, help=f"CPU cores (default: this machine's; --plan without "
                                                             f"CUDA: {PLAN_CORES})")
    p.add_argument("--plan", action="store_true", help="print the jobs, their minutes and the worker layout; run nothing "
                                                       "(without CUDA: for an 80 GB GPU)")
    args = p.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be 1 or more, got {args.workers}")
    import torch
    from labkit.records import GPU_DIR, gpu_records
    records = gpu_records(GPU_DIR)
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    try:
        jobs = select(args.notebooks, records, gpu)
    except ValueError as err:
        p.error(str(err))
    free = torch.cuda.mem_get_info()[0] if cuda else PLAN_GPU_BYTES
    cores = args.cores or (os.cpu_count() if cuda else PLAN_CORES) or 1
    workers = args.workers or workers_for(free, cores, len(jobs), args.fence)
    plan, load = layout(jobs, workers)
    where = gpu or "an 80 GB GPU (planned on a CPU)"
    print(f"test-gpu on {where}: {len(jobs)} jobs, {workers} workers ({free / GiB:.0f} GiB free, {cores} cores), "
          f"each notebook fenced to {args.fence / GiB:.1f} GiB; estimated {max(load, default=0):.1f} min (the longest "
          f"worker), {sum(j.minutes for j in jobs):.1f} min of jobs in all")
    for w, (names, minutes) in enumerate(zip(plan, load)):
        print(f"  worker {w}: {minutes:4.1f} min  " + ", ".join(f"{n[:2] if n[:2].isdigit() else n} "
                                                              f"({next(j.minutes for j in jobs if j.name == n):g})"
                                                              for n in names))
    if args.plan or not jobs:
        return 0
    if not cuda:
        print(f"make test-gpu needs a CUDA GPU, and torch {torch.__version__} sees none here.", file=sys.stderr)
        return 2
    env = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda}
    results, not_started = run(jobs, env, GPU_DIR, workers, args.budget, args.fence, args.started, cores=cores)
    text, status = summary(results, not_started, [j.name for j in select(None, records, gpu)],
                           gpu_records(GPU_DIR), gpu)
    print(text, flush=True)
    return status


if __name__ == "__main__":
    from labkit.scripts.gpu_run import main as _main
    sys.exit(_main())
