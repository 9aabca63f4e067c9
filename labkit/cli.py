"""`labkit doctor` and `labkit estimate MODEL ...` on the command line."""
from __future__ import annotations

import argparse
import json
import pathlib
import re

from .course import agenda, fill_agendas, instructor, strip_solutions, student

__all__ = ["main", "readiness", "notebook_meta", "strip_solutions", "index_html", "read_lock", "lock_differences",
           "affects"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS, BUILD = ROOT / "notebooks", ROOT / "build"
LOCK = pathlib.Path(__file__).resolve().parent / "lock.txt"     # every package's version, as verified


def notebook_meta(folder=NOTEBOOKS):
    """{notebook file name: its metadata['labkit']} for every NN_*.ipynb in `folder`."""
    return {p.name: json.loads(p.read_text())["metadata"].get("labkit", {})
            for p in sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb"))}


def readiness(meta):
    """('full' | 'partly' | 'no', reasons) for one notebook's metadata, on this machine."""
    from .device import has
    missing = [f for f in meta.get("requires", []) if not has(f)]
    if missing:
        return "no", [f"needs {f}" for f in missing]
    skipped = [f"without {f}: skips {what}" for f, what in meta.get("optional", {}).items() if not has(f)]
    return ("partly" if skipped else "full"), skipped


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()          # PyPI's spelling: PyYAML, pyyaml, py_yaml alike


def read_lock(path=LOCK):
    """{package: version} that the lock pins (`name==version` lines; comments and blank lines skipped)."""
    pins = {}
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"lock {path}: expected name==version, got {line!r}")
            pins[_norm(name)] = version.strip()
    return pins


def lock_differences(lock=LOCK, installed=None):
    """[(package, locked version, installed version or None)] for each pin this environment does not match.

    A local build label counts as the same version, as it does for pip: torch 2.13.0+cpu is torch==2.13.0.
    """
    from importlib.metadata import distributions
    from packaging.version import Version
    if installed is None:
        installed = {}
        for d in distributions():                         # the first one on sys.path is what imports
            if d.metadata["Name"]:
                installed.setdefault(_norm(d.metadata["Name"]), d.version)
    return [(name, want, installed.get(name)) for name, want in read_lock(lock).items()
            if name not in installed or Version(Version(installed[name]).public) != Version(want)]


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


def doctor(lock=LOCK):
    """The environment, its versions against the lock, and which notebooks run here. 1 if LABKIT_SIZE is bad."""
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
    print(f"\nVersions against the lock ({lock}):")
    if pathlib.Path(lock).exists():
        diffs, direct, up, uses = lock_differences(lock), *_dependency_graph(), _notebook_uses()
        for name, want, have in diffs:
            where = affects(name, direct, up, uses)
            print(f"  {name:<26} {have or 'missing':<14} lock {want:<12} may affect: {where}")
        if diffs:
            print(f"  {len(diffs)} of {len(read_lock(lock))} differ. `make env` installs the locked versions; "
                  "a GPU machine may keep its own torch.")
        else:
            print(f"  all {len(read_lock(lock))} pinned packages match")
    else:
        print("  no lock there: versions not checked")
    print("\nNotebooks here:")
    for name, meta in notebook_meta().items():
        verdict, reasons = readiness(meta)
        minutes = f"{meta.get('minutes_tiny', '?')} min tiny / {meta.get('minutes_full', '?')} min full"
        print(f"  {verdict:<7} {name:<40} {minutes}")
        for r in reasons:
            print(f"          {r}")
    return status


def _figure(key, value):
    from .units import fmt_bytes
    if isinstance(value, str):
        return value
    if key.endswith("_bytes"):
        return fmt_bytes(value)
    if key.endswith("_s"):
        return f"{value:.3g} s"
    if key.endswith("_ratio"):
        return f"{value:.3g}x"
    if key.endswith("_gap"):
        return f"{value:+.2%}"
    if key.endswith("_share"):
        return f"{value:.1%}"
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"


def index_html(records, executed):
    """The workbook's index page: each notebook, its status and the figures it recorded."""
    import html
    rows = []
    for name, status in executed.items():
        rec = records.get(pathlib.Path(name).stem, {})
        figs = "<br>".join(f"{html.escape(k)}: {html.escape(_figure(k, v))}" for k, v in rec.get("figures", {}).items())
        where = html.escape(f"{rec.get('size', '')} on {rec.get('device', '')}") if rec else ""
        link = f'<a href="{html.escape(pathlib.Path(name).stem)}.html">{html.escape(name)}</a>'
        rows.append(f"<tr><td>{link}</td><td>{html.escape(status)}</td><td>{where}</td><td>{figs}</td></tr>")
    return ("<!doctype html><meta charset=utf-8><title>GPU Memory Lab</title>"
            "<style>body{font-family:sans-serif;margin:2em}td,th{border-bottom:1px solid #ccc;padding:.4em;"
            "vertical-align:top;text-align:left}</style><h1>GPU Memory Lab: the workbook, executed</h1>"
            "<table><tr><th>notebook</th><th>status</th><th>where</th><th>headline figures</th></tr>"
            + "".join(rows) + "</table>")


def workbook(folder=NOTEBOOKS, build=BUILD):
    """Execute every notebook at the detected size into build/executed/, HTML into build/html/."""
    import time
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter
    from .device import size
    from .records import RECORDS_DIR
    executed_dir, html_dir = pathlib.Path(build) / "executed", pathlib.Path(build) / "html"
    executed_dir.mkdir(parents=True, exist_ok=True)
    html_dir.mkdir(parents=True, exist_ok=True)
    status = {}
    paths = sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb"))
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path.name} at size {size()} ...", flush=True)
        nb = nbformat.read(path, as_version=4)
        t0 = time.time()
        try:
            NotebookClient(nb, timeout=1800, resources={"metadata": {"path": str(path.parent)}}).execute()
            status[path.name] = f"ok in {time.time() - t0:.0f} s"
        except Exception as e:                       # keep going: the index says which one failed
            status[path.name] = f"FAILED after {time.time() - t0:.0f} s: {type(e).__name__}"
        print(f"    {status[path.name]}", flush=True)
        nbformat.write(nb, executed_dir / path.name)
        body, _ = HTMLExporter().from_notebook_node(nb)
        (html_dir / f"{path.stem}.html").write_text(body, encoding="utf-8")
    records = {p.stem: json.loads(p.read_text()) for p in RECORDS_DIR.glob("*.json")}
    (html_dir / "index.html").write_text(index_html(records, status), encoding="utf-8")
    print(f"open {html_dir / 'index.html'}")
    return 0 if all(v.startswith("ok") for v in status.values()) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(prog="labkit", description="GPU Memory Lab helpers")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="the environment, its versions against the lock, which notebooks run here")
    doc.add_argument("--lock", type=pathlib.Path, default=LOCK, help="the lock to compare with (default: %(default)s)")
    sub.add_parser("workbook", help="execute every notebook into build/executed and build/html")
    sub.add_parser("student", help="notebooks without solutions, into build/student")
    sub.add_parser("instructor", help="the answer key as an nbgrader course folder, into build/course")
    ag = sub.add_parser("agenda", help="a one- or two-day workshop agenda from the notebooks' measured minutes")
    ag.add_argument("--days", type=int, default=1, choices=[1, 2])
    ag.add_argument("--size", default="tiny", choices=["tiny", "full"])
    ag.add_argument("--write", type=pathlib.Path, metavar="MARKDOWN",
                    help="recompute the agenda blocks of this file in place (e.g. docs/instructor.md)")
    est = sub.add_parser("estimate", help="estimated memory of a model preset or of any config.json")
    est.add_argument("model", help="a preset (e.g. llama-2-7b), a family (e.g. mistral-7b) or a path to a config.json")
    est.add_argument("--seq", type=int, default=2048)
    est.add_argument("--batch", type=int, default=1)
    est.add_argument("--dtype", default="bf16", help="fp32, bf16, fp16, mixed, amp-bf16 or amp-fp16")
    est.add_argument("--train", metavar="OPTIMIZER", default=None,
                     help="estimate a training step with this optimizer (adamw, adam, sgd, ...)")
    est.add_argument("--recompute", action="store_true", help="full activation recomputation")
    est.add_argument("--kv-tokens", type=int, default=None, help="inference: tokens in the KV cache (default: seq)")
    est.add_argument("--size", default="full", choices=["tiny", "full"])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor(args.lock)
    if args.command == "workbook":
        return workbook()
    if args.command == "agenda":
        if args.write:
            args.write.write_text(fill_agendas(args.write.read_text(), args.size))
        else:
            print(agenda(args.days, args.size))
        return 0
    if args.command in ("student", "instructor"):
        {"student": student, "instructor": instructor}[args.command]()
        return 0
    from .estimate import estimate, load_config
    from .models import FAMILY_CONFIGS, PRESETS, config, family_config
    try:
        if args.model in PRESETS:
            cfg, where = config(args.model, args.size), args.size
        elif args.model in FAMILY_CONFIGS:
            cfg, where = family_config(args.model, args.size), args.size
        else:                                    # a user's own model: a config.json or a folder holding one
            cfg, where = load_config(pathlib.Path(args.model)), "config.json"
        e = estimate(cfg, args.batch, args.seq, args.dtype, args.train, training=args.train is not None,
                     recompute=args.recompute, kv_tokens=args.kv_tokens)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    mode = f"training with {args.train}" if args.train else "inference"
    print(f"{args.model} ({where}, {cfg.model_type}, {e.params / 1e6:,.1f}M params), batch {args.batch}, "
          f"seq {args.seq}, {args.dtype}, {mode}")
    print(e.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
