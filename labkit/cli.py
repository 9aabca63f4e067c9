"""`labkit doctor` and `labkit estimate MODEL ...` on the command line."""
from __future__ import annotations

import argparse
import json
import pathlib

__all__ = ["main", "readiness", "notebook_meta", "strip_solutions", "index_html"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS, BUILD = ROOT / "notebooks", ROOT / "build"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


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


def doctor():
    from .device import report
    report()
    print("\nNotebooks here:")
    for name, meta in notebook_meta().items():
        verdict, reasons = readiness(meta)
        minutes = f"{meta.get('minutes_tiny', '?')} min tiny / {meta.get('minutes_full', '?')} min full"
        print(f"  {verdict:<7} {name:<40} {minutes}")
        for r in reasons:
            print(f"          {r}")


def strip_solutions(source):
    """A cell's source with each BEGIN/END SOLUTION block replaced by a stub for the student."""
    out, inside, indent = [], False, ""
    for line in source.splitlines():
        if line.strip() == BEGIN:
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}# YOUR CODE HERE")
            out.append(f"{indent}raise NotImplementedError()")
        elif line.strip() == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r} in:\n{source}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r} in:\n{source}")
    return "\n".join(out)


def student(folder=NOTEBOOKS, dest=BUILD / "student"):
    """Copies of the notebooks without solutions, in build/student/."""
    import nbformat
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.source = strip_solutions(cell.source)
        nbformat.write(nb, dest / path.name)
        print(f"student version: {dest / path.name}")


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
    sub.add_parser("doctor", help="the environment and which notebooks run here")
    sub.add_parser("workbook", help="execute every notebook into build/executed and build/html")
    sub.add_parser("student", help="notebooks without solutions, into build/student")
    est = sub.add_parser("estimate", help="estimated memory of a model preset")
    est.add_argument("model", help="a preset, e.g. llama-2-7b")
    est.add_argument("--seq", type=int, default=2048)
    est.add_argument("--batch", type=int, default=1)
    est.add_argument("--dtype", default="bf16", help="fp32, bf16, fp16 or mixed")
    est.add_argument("--train", metavar="OPTIMIZER", default=None,
                     help="estimate a training step with this optimizer (adamw, adam, sgd, ...)")
    est.add_argument("--recompute", action="store_true", help="full activation recomputation")
    est.add_argument("--size", default="full", choices=["tiny", "full"])
    args = parser.parse_args(argv)
    if args.command == "doctor":
        doctor()
        return 0
    if args.command == "workbook":
        return workbook()
    if args.command == "student":
        student()
        return 0
    from .estimate import estimate
    from .models import config
    try:
        e = estimate(config(args.model, args.size), args.batch, args.seq, args.dtype,
                     args.train, training=args.train is not None, recompute=args.recompute)
    except ValueError as err:
        parser.error(str(err))
    mode = f"training with {args.train}" if args.train else "inference"
    print(f"{args.model} ({args.size}, {e.params / 1e9:.2f}B params), batch {args.batch}, seq {args.seq}, "
          f"{args.dtype}, {mode}")
    print(e.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
