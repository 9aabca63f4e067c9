"""`labkit doctor`, `labkit estimate MODEL ...` and `labkit plan MODEL ...` on the command line."""
from __future__ import annotations

import argparse
import json
import pathlib
import re

from .course import agenda, fill_agendas, instructor, student

__all__ = ["main", "readiness", "notebook_meta", "workbook", "read_lock", "lock_lines",
           "lock_differences", "affects", "platform_notes"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS, BUILD = ROOT / "notebooks", ROOT / "build"
LOCK = pathlib.Path(__file__).resolve().parent / "lock.txt"     # every package's version, as verified


def notebook_meta(folder=NOTEBOOKS):
    """{notebook file name: its metadata['labkit']} for every NN_*.ipynb in `folder`."""
    return {p.name: json.loads(p.read_text())["metadata"].get("labkit", {})
            for p in sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb"))}


def readiness(meta, linux_only=None):
    """('full' | 'partly' | 'no', reasons) for one notebook's metadata, on this machine.

    `linux_only`: why this notebook needs Linux, where this machine is not Linux (platform_notes).
    """
    from .device import has
    missing = [f for f in meta.get("requires", []) if not has(f)]
    if linux_only:
        return "no", [f"needs Linux: it {linux_only}", *(f"needs {f}" for f in missing)]
    if missing:
        return "no", [f"needs {f}" for f in missing]
    skipped = [f"without {f}: skips {what}" for f, what in meta.get("optional", {}).items() if not has(f)]
    return ("partly" if skipped else "full"), skipped


# What needs Linux, and why: notebook file name prefix -> the reason, for each system that lacks it.
_TORCHRUN = ("starts its ranks with torchrun over gloo, and labkit.launch stops them as a POSIX "
             "process group (os.killpg), which native Windows lacks")
_ENGINES = ("measures each engine's memory from Linux's /proc/self (VmHWM, clear_refs) with glibc's "
            "MALLOC_MMAP_THRESHOLD_ set")
NEEDS_LINUX = {
    "Windows": {"09_": _TORCHRUN, "10_": _TORCHRUN,
                "11_": _ENGINES + "; torch.compile's Inductor also builds C++ there (MSVC's cl.exe, "
                                  "from Visual Studio's Build Tools)"},
    "Darwin": {"11_": _ENGINES},
}


def platform_notes(system=None, compiler=None):
    """(lines to print, {notebook prefix: why it needs Linux}) for this operating system.

    `system` is platform.system() ('Linux', 'Darwin', 'Windows'); `compiler` the C++ compiler that
    Inductor needs for torch.compile on a CPU (notebook 11): None looks on PATH, False means none.
    """
    import platform
    import shutil
    system = platform.system() if system is None else system
    if compiler is None:
        compiler = next((c for c in ("c++", "g++", "clang++", "cl") if shutil.which(c)), False)
    linux_only = NEEDS_LINUX.get(system, {})
    lines = []
    if system == "Darwin":
        lines += ["macOS: every notebook runs at the tiny size on the CPU. Apple's GPU (MPS) is not used: "
                  "labkit measures CUDA or the CPU, and lk.device() is 'cpu' here.",
                  "triton has no macOS wheels: notebooks 08 and 12 run their plain PyTorch twins of the "
                  "Triton kernels."]
    elif system == "Windows":
        lines += ["Windows: WSL2 is the supported path (wsl --install, then in Ubuntu: git clone, make lab), "
                  "where make, gloo and torchrun work as on Linux.",
                  "Natively (the pip route) triton has no wheels: notebooks 08 and 12 run their plain "
                  "PyTorch twins of the Triton kernels; the notebooks below need Linux."]
    elif system != "Linux":
        lines += [f"{system}: not a platform this workbook is verified on (Linux, macOS, Windows)."]
    if not compiler and "11_" not in linux_only:
        lines += ["No C++ compiler on PATH (c++, g++, clang++ or cl): torch.compile's Inductor needs one on a "
                  "CPU (notebook 11). Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install."]
    return lines, linux_only


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()          # PyPI's spelling: PyYAML, pyyaml, py_yaml alike


def lock_lines(path=LOCK):
    """[(package, version, marker or None)] for every line of the lock, in order (comments skipped).

    The lock is universal (`make lock`: uv pip compile --universal): one line per package and platform
    family, `name==version ; marker` where the version or the package itself depends on the platform or
    the Python (triton on Linux only, pywinpty on Windows only, ...). pip reads it with `-c` as it is.
    """
    from packaging.markers import InvalidMarker, Marker
    lines = []
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        spec, _, marker = line.partition(";")
        name, sep, version = spec.partition("==")
        if not sep or not name.strip() or not version.strip() or " " in version.strip():
            raise ValueError(f"lock {path}: expected name==version [; marker], got {line!r}")
        try:
            marker = Marker(marker) if marker.strip() else None
        except InvalidMarker as err:
            raise ValueError(f"lock {path}: bad environment marker in {line!r}: {err}") from None
        lines.append((_norm(name.strip()), version.strip(), marker))
    return lines


def read_lock(path=LOCK, environment=None):
    """{package: version} that the lock pins for one machine: the lines whose markers apply to it.

    `environment` is a dict of marker variables (packaging.markers.default_environment() keys) that
    overrides this machine's, e.g. {"sys_platform": "darwin", "platform_machine": "arm64"}.
    """
    from packaging.markers import default_environment
    env = {**default_environment(), "extra": "", **(environment or {})}
    pins = {}
    for name, version, marker in lock_lines(path):
        if marker is None or marker.evaluate(env):
            if name in pins and pins[name] != version:
                raise ValueError(f"lock {path}: {name} is pinned to both {pins[name]} and {version} "
                                 f"for this machine; its markers overlap")
            pins[name] = version
    return pins


def lock_differences(lock=LOCK, installed=None, environment=None, needed=None):
    """[(package, locked version, installed version or None)] for each pin this environment does not match.

    Only the lock's lines whose markers apply here count (read_lock). A local build label counts as the
    same version, as it does for pip: torch 2.13.0+cpu is torch==2.13.0. `needed`: the packages whose
    absence counts (None: every one); a CPU-only torch needs none of the CUDA libraries the lock pins
    for Linux's CUDA torch.
    """
    from importlib.metadata import distributions
    from packaging.version import Version
    if installed is None:
        installed = {}
        for d in distributions():                         # the first one on sys.path is what imports
            if d.metadata["Name"]:
                installed.setdefault(_norm(d.metadata["Name"]), d.version)
    return [(name, want, installed.get(name)) for name, want in read_lock(lock, environment).items()
            if (name in installed and Version(Version(installed[name]).public) != Version(want))
            or (name not in installed and (needed is None or name in needed))]


def _installed_names():
    from importlib.metadata import distributions
    return {_norm(d.metadata["Name"]) for d in distributions() if d.metadata["Name"]}


def _dependency_graph():
    """({labkit's direct dependency: its extra, '' if required}, {package: installed packages requiring it})."""
    from importlib.metadata import PackageNotFoundError, distributions, requires
    from packaging.requirements import Requirement
    try:
        own = [Requirement(r) for r in requires("labkit") or []]
    except PackageNotFoundError:                          # labkit imported from a folder, not installed
        own = []
    direct = {_norm(r.name): re.search(r'extra == "(\w+)"', str(r.marker or "")) for r in own}
    direct = {name: m.group(1) if m else "" for name, m in direct.items() if name != "labkit"}
    up = {}
    for d in distributions():
        for spec in d.requires or []:
            req = Requirement(spec)
            if d.metadata["Name"] and (req.marker is None or req.marker.evaluate({"extra": ""})):
                up.setdefault(_norm(req.name), set()).add(_norm(d.metadata["Name"]))
    return direct, up


def affects(package, direct, up, uses):
    """In words, which notebooks another version of `package` may change.

    `direct` and `up` come from _dependency_graph(); `uses` is {notebook: the modules it imports and the
    features its metadata names}. Walks from `package` up to labkit's direct dependencies: a required one
    (torch, transformers, ...) touches every notebook; an optional one the notebooks that import it.
    """
    seen, todo = set(), [package]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo += up.get(p, ())
    roots = sorted(p for p in seen if p in direct)
    required = [r for r in roots if direct[r] == ""]
    named = {r: [nb for nb, names in uses.items() if r.replace("-", "_") in names] for r in roots}
    notebooks = sorted({nb for r in roots for nb in named[r]})
    extras = {direct[r] for r in roots}
    if required:
        answer, through = "all notebooks", required
    elif notebooks:
        answer, through = ", ".join(notebooks), [r for r in roots if named[r]]
    elif "lab" in extras:
        return "JupyterLab itself (make lab), not what the notebooks compute"
    elif "test" in extras:
        return "the tests (make test), not the notebooks"
    else:
        return "no notebook (labkit does not use it)"
    return answer if package in through else f"{answer} (through {', '.join(through[:2])})"


def _notebook_uses(folder=NOTEBOOKS):
    """{notebook: the top-level modules its code imports and the features its metadata names}."""
    uses = {}
    for p in sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(p.read_text())
        code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        meta = nb["metadata"].get("labkit", {})
        uses[p.name] = {*re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.M), *meta.get("requires", []),
                        *meta.get("optional", {})}
    return uses


def doctor(lock=LOCK, system=None):
    """The environment, its versions against the lock, and which notebooks run here. 1 if LABKIT_SIZE is bad.

    Only the lock's lines whose markers apply to this machine count. `system` (platform.system()'s
    name) is for tests: what doctor says on another operating system.
    """
    import os
    from unittest import mock
    from .device import report, size
    status = 0
    try:
        size()
    except ValueError as err:
        print(f"PROBLEM: {err}. Unset it or set it to tiny or full; below, the report as if it were unset.\n")
        status = 1
    with mock.patch.dict(os.environ, {"LABKIT_SIZE": ""} if status else {}):
        report()
    print(f"\nVersions against the lock ({lock}, the lines for this platform and Python):")
    if pathlib.Path(lock).exists():
        direct, up = _dependency_graph()
        # Missing counts for what labkit or an installed package requires here (not the CUDA libraries of
        # Linux's CUDA torch beside a CPU-only one); without an installed labkit, every pin counts.
        diffs = lock_differences(lock, needed=({"labkit", *direct, *up} if direct else None))
        uses = _notebook_uses()
        for name, want, have in diffs:
            where = affects(name, direct, up, uses)
            print(f"  {name:<26} {have or 'missing':<14} lock {want:<12} may affect: {where}")
        pins = read_lock(lock)
        installed, differing = _installed_names(), {d[0] for d in diffs}     # read once: each read parses every package's metadata
        unused = [n for n in pins if n not in installed and n not in differing]
        if diffs:
            print(f"  {len(diffs)} of {len(pins)} differ. `make env` installs the locked versions; "
                  "a GPU machine may keep its own torch.")
        else:
            print(f"  all {len(pins) - len(unused)} pinned packages match")
        if unused:
            print(f"  ({len(unused)} more pins for this platform are for packages nothing here requires, "
                  f"{', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}; beside a CPU-only torch, the CUDA "
                  "libraries of the registry's torch)")
    else:
        print("  no lock there: versions not checked")
    notes, linux_only = platform_notes(system)
    if notes:
        print("\nThis platform:")
        for line in notes:
            print(f"  {line}")
    print("\nNotebooks here:")
    for name, meta in notebook_meta().items():
        verdict, reasons = readiness(meta, next((why for pre, why in linux_only.items() if name.startswith(pre)),
                                                None))
        minutes = f"{meta.get('minutes_tiny', '?')} min tiny / {meta.get('minutes_full', '?')} min full"
        print(f"  {verdict:<7} {name:<40} {minutes}")
        for r in reasons:
            print(f"          {r}")
    return status


def workbook(folder=NOTEBOOKS, build=BUILD, cell_timeout=None, notebooks=None):
    """Execute the notebooks and write build/html/index.html (labkit.workbook.run)."""
    from .workbook import run
    return run(notebooks, folder, build, cell_timeout)


def student_in_step(folder=NOTEBOOKS, dest=BUILD / "student"):
    """The student build in `dest` brought in step with `folder` (what `make lab` opens), keeping the learner's work.

    A notebook the learner has not changed since it was written here (its hash is in
    dest/.labkit-student.json) is rewritten from `folder`; a missing one is written. One the learner
    has changed is kept as it is; if the course's version changed since, the new student version goes
    to dest/updated/ beside it, and a line says so. Returns the notebooks written or updated.
    """
    import hashlib
    import tempfile
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    state_path = dest / ".labkit-student.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    def digest(data):
        return hashlib.sha256(data).hexdigest()

    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for fresh in student(folder, tmp, quiet=True):
            new, target = fresh.read_bytes(), dest / fresh.name
            mine = digest(target.read_bytes()) if target.exists() else None
            if mine is None or mine == state.get(fresh.name):       # absent, or as we wrote it: in step
                if mine != digest(new):
                    target.write_bytes(new)
                    written.append(target)
                state[fresh.name] = digest(new)
            elif mine == digest(new):
                state[fresh.name] = mine
            elif digest(new) != state.get(f"{fresh.name} offered"):   # the learner's copy, and a new course one
                (dest / "updated").mkdir(exist_ok=True)
                (dest / "updated" / fresh.name).write_bytes(new)
                state[f"{fresh.name} offered"] = digest(new)
                print(f"kept your {target} (you changed it); notebooks/{fresh.name} has changed since: "
                      f"the new student version is {dest / 'updated' / fresh.name}")
    state_path.write_text(json.dumps(state, indent=1, sort_keys=True))
    return written


def main(argv=None):
    parser = argparse.ArgumentParser(prog="labkit", description="GPU Memory Lab helpers")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="the environment, its versions against the lock, which notebooks run here")
    doc.add_argument("--lock", type=pathlib.Path, default=LOCK, help="the lock to compare with (default: %(default)s)")
    wb = sub.add_parser("workbook", help="execute the notebooks into build/executed, the page into build/html/index.html")
    wb.add_argument("--notebooks", nargs="*", default=None, metavar="NN",
                    help="only these notebooks, by number or name (default: all), e.g. --notebooks 05 10")
    wb.add_argument("--cell-timeout", type=int, default=None, metavar="SECONDS",
                    help="fail a notebook whose cell runs longer (default: 300 at tiny size, 900 at full)")
    st = sub.add_parser("student", help="notebooks without solutions, into build/student (a notebook the learner "
                                        "changed there is kept; the course's new version goes beside it)")
    st.add_argument("--in-step", action="store_true", help="one line in all, not one per notebook (what `make lab` runs)")
    st.add_argument("--dest", type=pathlib.Path, default=BUILD / "student", help="the student build (default: %(default)s)")
    sub.add_parser("instructor", help="the answer key as an nbgrader course folder, into build/course")
    ag = sub.add_parser("agenda", help="a one- or two-day workshop agenda from the notebooks' measured minutes")
    ag.add_argument("--days", type=int, default=1, choices=[1, 2])
    ag.add_argument("--size", default="tiny", choices=["tiny", "full"])
    ag.add_argument("--write", type=pathlib.Path, metavar="MARKDOWN",
                    help="recompute the agenda blocks of this file in place (e.g. docs/instructor.md)")
    est = sub.add_parser("estimate", help="estimated memory of a model preset or of any config.json")
    est.add_argument("model", help="a preset (e.g. llama-2-7b), a family (e.g. mistral-7b) or a path to a config.json")
    est.add_argument("--seq", type=int, default=None,
                     help="sequence length (default: 2048, or the model's max_position_embeddings if smaller)")
    est.add_argument("--batch", type=int, default=1)
    est.add_argument("--dtype", default="bf16", help="fp32, bf16, fp16, mixed, amp-bf16 or amp-fp16")
    est.add_argument("--train", metavar="OPTIMIZER", default=None,
                     help="estimate a training step with this optimizer (adamw, adam, sgd, adamw-8bit, ...)")
    est.add_argument("--recompute", action="store_true", help="full activation recomputation")
    est.add_argument("--kv-tokens", type=int, default=None, help="inference: tokens in the KV cache (default: seq)")
    est.add_argument("--max-positions", type=int, default=None, metavar="N",
                     help="estimate beyond the config's max_position_embeddings, up to N")
    est.add_argument("--size", default="full", choices=["tiny", "full"])
    pl = sub.add_parser("plan", help="will it fit? the levers practitioners use, combined for a model, a task and "
                                     "a GPU, ranked")
    pl.add_argument("model", nargs="?", help="a preset (e.g. llama-2-7b), a family or a path to a config.json")
    pl.add_argument("--task", help="pretrain, finetune, lora, qlora or serve")
    pl.add_argument("--gpu", help="a GPU of data/gpus.csv (e.g. L4, H100) or its memory as the driver reports it "
                                  "('24 GiB')")
    pl.add_argument("--gpus", type=int, default=1)
    pl.add_argument("--seq", type=int, default=2048, help="sequence length (serve: the context length)")
    pl.add_argument("--batch", type=int, default=1, help="sequences per step (serve: concurrent sequences)")
    pl.add_argument("--host-mem", default=None, metavar="SIZE",
                    help="the node's CPU memory for offloaded state, e.g. '512 GiB' (default: twice the GPUs' "
                         "memory, at least 64 GiB: labkit.plan.capacity)")
    pl.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE",
                    help="fix a lever instead of searching it, e.g. --lever rank=16 --lever targets=q+v (repeatable)")
    pl.add_argument("--rows", type=int, default=10, help="rows of the table or of --json (default: %(default)s)")
    pl.add_argument("--json", action="store_true", help="the question, the answer and the first --rows plans as JSON")
    pl.add_argument("--verify", action="store_true", help="measure the top plan on fake tensors (labkit.plan.verify)")
    pl.add_argument("--recipes", action="store_true",
                    help="every published recipe of data/recipes.csv beside the planner's answer, then last round's "
                         "three plans (no model, task or gpu needed)")
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_command(args, pl)
    if args.command == "doctor":
        return doctor(args.lock)
    if args.command == "workbook":
        try:
            return workbook(cell_timeout=args.cell_timeout, notebooks=args.notebooks)
        except ValueError as err:
            parser.error(str(err))
    if args.command == "student":
        written = student_in_step(dest=args.dest)
        if not args.in_step:
            for path in written:
                print(f"student version: {path}")
        print(f"{args.dest}: {len(written)} notebook(s) brought in step with notebooks/" if written
              else f"{args.dest} is in step with notebooks/")
        return 0
    if args.command == "agenda":
        if args.write:
            args.write.write_text(fill_agendas(args.write.read_text(), args.size))
        else:
            print(agenda(args.days, args.size))
        return 0
    if args.command == "instructor":
        instructor()
        return 0
    return estimate_command(args, est)


DEFAULT_SEQ = 2048


def estimate_command(args, parser):
    """`labkit estimate`: the estimate table, or one line naming what is wrong with the input."""
    from .estimate import estimate, load_config
    from .models import FAMILY_CONFIGS, PRESETS, config, family_config
    try:
        if args.model in PRESETS:
            cfg, where = config(args.model, args.size), args.size
        elif args.model in FAMILY_CONFIGS:
            cfg, where = family_config(args.model, args.size), args.size
        else:                                    # a user's own model: a config.json or a folder holding one
            cfg, where = load_config(pathlib.Path(args.model)), "config.json"
        seq, note = args.seq, ""
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if seq is None:
            seq = min(DEFAULT_SEQ, limit) if limit else DEFAULT_SEQ
            if seq != DEFAULT_SEQ:
                note = f" (--seq defaults to {DEFAULT_SEQ}; this model's max_position_embeddings is {limit})"
        if limit and max(seq, args.kv_tokens or 0) > limit and not args.max_positions:
            longest = max(seq, args.kv_tokens or 0)
            raise ValueError(f"--seq {seq}{f' with --kv-tokens {args.kv_tokens}' if args.kv_tokens else ''} is "
                             f"beyond this model's max_position_embeddings {limit}; pass --seq {limit} or less, or "
                             f"--max-positions {longest} to estimate beyond it anyway")
        e = estimate(cfg, args.batch, seq, args.dtype, args.train, training=args.train is not None,
                     recompute=args.recompute, kv_tokens=args.kv_tokens, max_positions=args.max_positions)
    except (ValueError, FileNotFoundError, TypeError) as err:
        parser.error(" ".join(str(err).split()))
    mode = f"training with {args.train}" if args.train else "inference"
    print(f"{args.model} ({where}, {cfg.model_type}, {e.params / 1e6:,.1f}M params), batch {args.batch}, "
          f"seq {seq}{note}, {args.dtype}, {mode}")
    print(e.table())
    return 0


def plan_command(args, parser):
    """`labkit plan`: the ranked table (or JSON), the answer when nothing fits, or one line naming what is wrong."""
    from .plan import parse_levers, plan, recipes_table
    if args.rows < 1:
        parser.error(f"--rows must be >= 1, got {args.rows}")
    if args.recipes:
        print(recipes_table())
        return 0
    missing = [f for f in ("model", "task", "gpu") if getattr(args, f) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required (or --recipes)")
    try:
        levers = parse_levers(";".join(args.lever))
        plans = plan(args.model, args.task, args.gpu, gpus=args.gpus, seq=args.seq, batch=args.batch,
                     host_memory=args.host_mem, levers=levers, verify=args.verify)
    except (ValueError, TypeError, FileNotFoundError) as err:
        parser.error(" ".join(str(err).split()))
    print(plans.to_json(args.rows) if args.json else plans.table(args.rows))
    return 0 if plans.best else 1            # 1: nothing fits (the table says why)


if __name__ == "__main__":
    raise SystemExit(main())
