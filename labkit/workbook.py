"""`make workbook`: execute the notebooks, then write build/html/index.html, the page an instructor projects.

One section per notebook: its title, what it teaches, how its run went, the first plot it drew (linking to
the executed notebook) and its headline figures (what `lk.record` saved) with human labels and units, the
published figure beside each where one exists, with its source, and the gap. Each machine that measured a
figure has a column: this machine at its size (build/records/) and every GPU record in data/gpu/
(`make gpu-smoke`), dated. The labels, units, published figures and sources are data, in
data/workbook.json; a figure no machine measured says "not measured".
"""
from __future__ import annotations

import datetime
import html
import json
import logging
import os
import pathlib
import platform
import re
import time

from .checks import count
from .data import DATA_DIR
from .units import fmt_figure

__all__ = ["run", "page", "sections", "registry", "label", "machines", "gpu_runs", "published_gap", "executed_facts",
           "select", "CELL_TIMEOUT_S", "REGISTRY"]

REGISTRY = DATA_DIR / "workbook.json"
ROOT = pathlib.Path(__file__).resolve().parent.parent
# A cell that runs longer than this fails its notebook, and the workbook goes on to the next one
# (as nbval's --nbval-cell-timeout does for `make test` and `make test-gpu`).
CELL_TIMEOUT_S = {"tiny": 300, "full": 900}
_UNITS = {"_bytes": "bytes", "_s": "seconds", "_ratio": "×", "_gap": "%", "_share": "%"}
_GPU_SKIP = {"gpu", "date", "check", "torch", "status", "seconds", "cuda", "error", "reason", "traceback"}


def registry(path=None):
    """data/workbook.json: {"notebooks": {stem: {"teaches"}}, "figures": {stem: {key: {"label", "published",
    "source", "size"}}}, "gpu_checks": {check: stem}}."""
    path = pathlib.Path(path or REGISTRY)
    try:
        reg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"registry {path} is missing: it holds the workbook's labels") from None
    for part in ("notebooks", "figures", "gpu_checks"):
        reg.setdefault(part, {})
    return reg


def label(notebook, key, reg):
    """The human label of a figure: the registry's, else its name in words ("peak_bytes" -> "peak")."""
    entry = reg["figures"].get(notebook, {}).get(key, {})
    if entry.get("label"):
        return entry["label"]
    check, _, key = key.rpartition(".")            # a GPU check's figure: "flash.fwd_tflops"
    words = key
    for suffix in _UNITS:
        if words.endswith(suffix):
            words = words[: -len(suffix)]
            break
    words = words.replace("_", " ").strip() or key.replace("_", " ")
    words = words[0].upper() + words[1:]
    return f"{words} (GPU check {check!r})" if check else words


def _unit(key):
    return next((unit for suffix, unit in _UNITS.items() if key.endswith(suffix)), "")


def published_gap(value, published):
    """How far a measured number is from a published one: a signed fraction for a number, 0 inside a range
    [low, high] (else the distance to the nearer end, as a fraction of it); None if either is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(published, (list, tuple)) and len(published) == 2:
        low, high = published
        if low <= value <= high:
            return 0.0
        end = low if value < low else high
        return (value - end) / abs(end) if end else None
    if isinstance(published, (int, float)) and not isinstance(published, bool) and published:
        return value / published - 1
    return None


def _fmt(key, value, entry):
    """A figure as text: by its name's suffix (fmt_figure), or as a plain number where the registry names
    its unit (an exponent, bytes/param)."""
    if entry.get("as") and not isinstance(value, str):     # formatted as a name with that suffix would be
        return fmt_figure(entry["as"], value)
    if entry.get("unit") and not isinstance(value, str):
        return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"
    return fmt_figure(key, value)


def _published_text(key, published, entry):
    if isinstance(published, (list, tuple)):
        return f"{_fmt(key, published[0], entry)} to {_fmt(key, published[1], entry)}"
    return _fmt(key, published, entry)


def machines(records, gpu_records, reg):
    """Columns of the figure tables: [{"name", "size", "date", "figures": {(stem, key): value}}], this
    machine's records first, then one column per GPU and date."""
    cols = {}
    for stem, rec in sorted(records.items()):
        device = rec.get("device", "cpu")
        name = "this CPU" if device == "cpu" else device
        col = cols.setdefault((name, rec.get("size", "?")), {"name": name, "size": rec.get("size", "?"),
                                                              "date": "", "figures": {}})
        col["date"] = max(col["date"], str(rec.get("when", ""))[:10])
        for key, value in rec.get("figures", {}).items():
            col["figures"][(stem, key)] = value
    for rec in sorted(gpu_records, key=lambda r: r["date"]):
        stem = reg["gpu_checks"].get(rec["check"], rec["check"])
        if rec.get("status", "ok") != "ok" or rec["check"].startswith(_RUN):    # a whole run: gpu_runs() shows it
            continue
        day = rec["date"][:10]
        col = cols.setdefault((rec["gpu"], day), {"name": rec["gpu"], "size": "full", "date": day, "figures": {}})
        for key, value in rec.items():
            if key not in _GPU_SKIP and isinstance(value, (int, float, str)) and not isinstance(value, bool):
                col["figures"][(stem, f"{rec['check']}.{key}" if rec["check"] != stem else key)] = value
    return list(cols.values())


_RUN = "test-gpu:"


def gpu_runs(gpu_records, folder):
    """{notebook: [the latest `make test-gpu` run of it on each GPU]}: dicts with "gpu", "date", "status",
    "seconds", "peak_reserved_bytes", "fence_bytes", "why" (a failed cell or a reason) and "current" (the
    record is about the notebook as it is now, by its hash)."""
    import hashlib
    latest = {}
    for rec in sorted(gpu_records, key=lambda r: r["date"]):
        if rec["check"].startswith(_RUN):
            latest[(rec["check"][len(_RUN):], rec["gpu"])] = rec
    out = {}
    for (stem, gpu), rec in sorted(latest.items()):
        path = pathlib.Path(folder) / f"{stem}.ipynb"
        sha = hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.exists() else None
        out.setdefault(stem, []).append({
            "gpu": gpu, "date": rec["date"][:10], "status": rec.get("status", "?"), "seconds": rec.get("seconds"),
            "peak_reserved_bytes": rec.get("peak_reserved_bytes"), "fence_bytes": rec.get("fence_bytes"),
            "why": rec.get("failed") or rec.get("error") or rec.get("reason") or "",
            "current": sha is not None and rec.get("notebook_sha") == sha})
    return out


def _gpu_text(run):
    """One notebook's run on one GPU, in words: "passed on NVIDIA H200 (2026-11-20, 1.4 min, peak 12.3 GiB of 22 GiB)"."""
    verb = {"ok": "passed", "failed": "FAILED", "skipped": "cut short"}.get(run["status"], run["status"])
    facts = [run["date"]]
    if isinstance(run["seconds"], (int, float)):
        facts.append(f"{run['seconds'] / 60:.1f} min")
    if isinstance(run["peak_reserved_bytes"], int) and isinstance(run["fence_bytes"], int):
        facts.append(f"peak {fmt_figure('x_bytes', run['peak_reserved_bytes'])} of "
                     f"{fmt_figure('x_bytes', run['fence_bytes'])}")
    if not run["current"]:
        facts.append("an earlier version of this notebook")
    why = f": {run['why'].splitlines()[0][:160]}" if run["why"] and run["status"] != "ok" else ""
    return f"{verb} on {run['gpu']} ({', '.join(facts)}){why}"


def _rows(stem, reg, cols):
    """The figure rows of one notebook: the registry's keys first (published figures a run may not have
    measured yet), then every other key a machine measured."""
    keys = list(reg["figures"].get(stem, {}))
    for col in cols:
        keys += [k for (s, k) in col["figures"] if s == stem and k not in keys]
    rows = []
    for key in keys:
        entry = reg["figures"].get(stem, {}).get(key, {})
        short = key.split(".")[-1]
        values, gaps = [], []
        for col in cols:
            value = col["figures"].get((stem, key))
            values.append("not measured" if value is None else _fmt(short, value, entry))
            compare = entry.get("size", "any") in ("any", col["size"])
            gap = published_gap(value, entry.get("published")) if compare else None
            gaps.append("" if gap is None else f"{gap:+.0%} ({col['name']})")
        published = entry.get("published")
        rows.append({"key": key, "label": label(stem, key, reg), "unit": entry.get("unit") or _unit(short),
                     "values": values,
                     "published": "" if published is None else _published_text(short, published, entry),
                     "source": entry.get("source", ""), "gap": "; ".join(g for g in gaps if g)})
    return rows


def executed_facts(nb):
    """(title, first plot as a data: URI or None, the skip messages it printed) of an executed notebook."""
    title, image, skipped = "", None, []
    for cell in nb.cells:
        if not title and cell.cell_type == "markdown":
            title = next((l.lstrip("# ").strip() for l in cell.source.splitlines() if l.startswith("#")), "")
        for out in cell.get("outputs", []):
            if image is None and "image/png" in out.get("data", {}):
                image = "data:image/png;base64," + out["data"]["image/png"].replace("\n", "")
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            skipped += [l.strip() for l in text.splitlines() if l.strip().startswith("Skipped:")]
    return title, image, skipped


def sections(status, folder, build, reg, cols, runs=None):
    """One dict per notebook in `status` ({stem: {"status", "seconds"}}), in order; `runs`: gpu_runs()."""
    import nbformat
    out = []
    for stem, st in sorted(status.items()):
        executed = pathlib.Path(build) / "executed" / f"{stem}.ipynb"
        source = pathlib.Path(folder) / f"{stem}.ipynb"
        path = executed if executed.exists() else source
        title, image, skipped = (executed_facts(nbformat.read(path, as_version=4)) if path.exists()
                                 else (stem, None, []))
        out.append({"stem": stem, "title": title or stem, "teaches": reg["notebooks"].get(stem, {}).get("teaches", ""),
                    "status": st["status"], "seconds": st.get("seconds"), "when": st.get("when", ""),
                    "image": image, "skipped": skipped, "html": f"{stem}.html" if executed.exists() else None,
                    "rows": _rows(stem, reg, cols), "gpu": (runs or {}).get(stem, [])})
    return out


_CSS = """
:root{--bg:#fff;--fg:#111;--muted:#555;--line:#ccc;--ok:#176e2b;--bad:#b00020;--card:#f4f4f4}
@media (prefers-color-scheme:dark){:root{--bg:#121212;--fg:#eee;--muted:#aaa;--line:#444;--ok:#6fd38a;
--bad:#ff6b81;--card:#1e1e1e}}
body{background:var(--bg);color:var(--fg);font:20px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:72em;
padding:0 1em}
h1{font-size:2em;margin:.2em 0} h2{font-size:1.45em;margin:1.6em 0 .3em} .muted{color:var(--muted)}
.ok{color:var(--ok);font-weight:600} .failed{color:var(--bad);font-weight:600}
table{border-collapse:collapse;width:100%;margin:.5em 0} td,th{border-bottom:1px solid var(--line);
padding:.35em .5em;text-align:left;vertical-align:top} th{font-size:.85em;color:var(--muted)}
.summary{background:var(--card);padding:.8em 1.2em;border-radius:.4em}
section{page-break-inside:avoid;break-inside:avoid} img.thumb{max-width:24em;width:100%;float:right;
margin:0 0 .5em 1em;border:1px solid var(--line);background:#fff}
.notmeasured{color:var(--muted);font-style:italic} a{color:inherit}
@media print{:root{--bg:#fff;--fg:#000;--muted:#444;--line:#999;--card:#eee}body{font-size:12pt;max-width:none}
img.thumb{max-width:40%}}
"""


def _cell(text):
    cls = ' class="notmeasured"' if text == "not measured" else ""
    return f"<td{cls}>{html.escape(text)}</td>"


def _section_html(sec, cols):
    e = html.escape
    ok = sec["status"].startswith("ok")
    head = f'<h2 id="{e(sec["stem"])}">{e(sec["title"])}</h2>'
    img = (f'<a href="{e(sec["html"] or "#")}"><img class="thumb" alt="first plot of {e(sec["title"])}" '
           f'src="{sec["image"]}"></a>' if sec["image"] else "")
    minutes = f', {sec["seconds"] / 60:.1f} min' if isinstance(sec["seconds"], (int, float)) else ""
    link = f' · <a href="{e(sec["html"])}">the executed notebook</a>' if sec["html"] else ""
    kept = sec["status"].startswith("not run")
    status = (f'<p><span class="{"ok" if ok else "muted" if kept else "failed"}">{e(sec["status"])}</span>{e(minutes)}'
              f'{" · " + e(sec["when"]) if sec["when"] else ""}{link}</p>')
    skipped = "".join(f"<li>{e(s)}</li>" for s in sec["skipped"])
    skipped = f"<p>Skipped sections:</p><ul>{skipped}</ul>" if skipped else ""
    heads = "".join(f"<th>{e(c['name'])}<br>{e(c['size'])}, {e(c['date'])}</th>" for c in cols)
    rows = "".join(f"<tr><td>{e(r['label'])}</td><td>{e(r['unit'])}</td>{''.join(_cell(v) for v in r['values'])}"
                   f"<td>{e(r['published'])}</td><td>{e(r['source'])}</td><td>{e(r['gap'])}</td></tr>"
                   for r in sec["rows"])
    table = (f"<table><tr><th>figure</th><th>unit</th>{heads}<th>published</th><th>source</th>"
             f"<th>gap to published</th></tr>{rows}</table>" if sec["rows"] else
             '<p class="muted">This notebook records no headline figures.</p>')
    teaches = f'<p class="muted">{e(sec["teaches"])}</p>' if sec["teaches"] else ""
    runs = sec.get("gpu", [])
    gpu = ("<p>At full size: " + "; ".join(
        f'<span class="{"ok" if r["status"] == "ok" and r["current"] else "muted" if r["status"] == "ok" else "failed"}">'
        f'{e(_gpu_text(r))}</span>' for r in runs) + "</p>") if runs else \
        '<p class="muted">At full size: not run on a GPU yet (<code>make test-gpu</code>).</p>'
    return f"<section>{img}{head}{teaches}{status}{gpu}{skipped}{table}</section>"


def page(secs, cols, machine):
    """The self-contained index page (no network: styles inline, plots as data: URIs)."""
    e = html.escape
    failed = [s for s in secs if not s["status"].startswith(("ok", "not run"))]
    ran = [s for s in secs if not s["status"].startswith("not run")]
    seconds = sum(s["seconds"] or 0 for s in ran)
    skipped = "".join(f"<li>{e(s['stem'][:2])}: {e(msg)}</li>" for s in secs for msg in s["skipped"])
    kept = len(secs) - len(ran)
    gpus = sorted({r["gpu"] for s in secs for r in s.get("gpu", [])})
    full = "".join(f"<p>At full size on {e(g)}: <b>{sum(any(r['gpu'] == g and r['status'] == 'ok' and r['current'] for r in s.get('gpu', [])) for s in secs)}</b> of {len(secs)} notebooks passed (<code>make test-gpu</code>).</p>" for g in gpus) \
        or "<p>No notebook has run at full size on a GPU yet (<code>make test-gpu</code>).</p>"
    summary = (f'<div class="summary"><p><b>{len(ran)}</b> notebook(s) run this time'
               f'{f" ({kept} more shown from earlier runs)" if kept else ""}, '
               f'<b class="{"failed" if failed else "ok"}">{len(failed)} failed</b>'
               f'{" (" + ", ".join(e(s["stem"]) for s in failed) + ")" if failed else ""}, '
               f'{seconds / 60:.1f} minutes in all, on {e(machine)}.</p>'
               + full + (f"<p>Sections skipped on this machine:</p><ul>{skipped}</ul>" if skipped else
                         "<p>No section was skipped.</p>") + "</div>")
    return ("<!doctype html><html lang=en><meta charset=utf-8><meta name=viewport content='width=device-width'>"
            f"<title>GPU Memory Lab: the workbook</title><style>{_CSS}</style>"
            f"<h1>GPU Memory Lab: the workbook, executed</h1>{summary}"
            + "".join(_section_html(s, cols) for s in secs) + "</html>")


def this_machine():
    """One line naming this machine: its GPU or CPU model and cores, the OS, Python and torch."""
    import torch
    from .device import size
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        cpuinfo = pathlib.Path("/proc/cpuinfo")
        names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else []
        device = f"{names[0] if names else platform.processor() or 'a CPU'} ({os.cpu_count()} cores)"
    return (f"{device}, {platform.system()} {platform.machine()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, size {size()}")


def select(names, folder):
    """The notebooks to run: every NN_*.ipynb of `folder`, or those whose number or name is in `names`."""
    paths = sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return paths
    chosen = []
    for name in names:
        match = [p for p in paths if p.stem == name or p.stem[:2] == str(name).zfill(2) or p.name == name]
        if not match:
            raise ValueError(f"notebooks: {name!r} names no notebook of {folder}; there are "
                             f"{', '.join(p.stem[:2] for p in paths)}")
        chosen += [p for p in match if p not in chosen]
    return chosen


# nbclient logs each timeout and dead kernel as an ERROR of its own; the status line says it once.
_QUIET = logging.getLogger("labkit.workbook.nbclient")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


def _execute(path, cell_timeout, log):
    """Run one notebook in a fresh kernel; (the executed notebook, status text, seconds)."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    cells = sum(c.cell_type == "code" for c in nb.cells)
    t0 = last = time.time()
    done = 0

    def progress(cell, cell_index, **_):
        nonlocal last, done
        done += cell.cell_type == "code"
        if time.time() - last >= 20:               # a line every 20 s at most: it is alive, and where
            last = time.time()
            log(f"    ... code cell {done} of {cells} done, {last - t0:.0f} s")

    # The kernel's own log stays quiet (ipykernel warns once per kernel that it runs over TCP on localhost);
    # its errors and the notebook's own stderr are kept.
    client = NotebookClient(nb, timeout=cell_timeout, startup_timeout=120, shutdown_kernel="immediate",
                            extra_arguments=["--IPKernelApp.log_level=ERROR"], on_cell_executed=progress,
                            log=_QUIET,
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
        return nb, "ok", time.time() - t0
    except Exception as err:                        # keep going: the page says which one failed, and why
        kind = type(err).__name__
        err = re.sub(r"\x1b\[[0-9;]*m", "", str(err))     # the traceback's terminal colours
        why = (f"a cell ran past {cell_timeout} s" if kind == "CellTimeoutError" else
               "its kernel died" if kind == "DeadKernelError" else
               f"{kind}: {err.strip().splitlines()[-1][:200]}" if err.strip() else kind)
        return nb, f"FAILED after {time.time() - t0:.0f} s: {why}", time.time() - t0


def run(names=None, folder=None, build=None, cell_timeout=None, log=print):
    """Execute the notebooks (all, or `names`: numbers like "05" or names), write build/executed/,
    build/html/<notebook>.html and build/html/index.html; returns 0 if every notebook run passed, else 1.

    Each cell may run `cell_timeout` seconds (default CELL_TIMEOUT_S for the size); a notebook whose cell
    runs longer, or whose kernel dies, is marked FAILED, its kernel shut down, and the next one runs.
    Notebooks not run this time keep the status of their last run (build/html/status.json)."""
    from nbconvert import HTMLExporter
    import nbformat
    from .device import size
    from .records import GPU_DIR, RECORDS_DIR, gpu_records
    folder = pathlib.Path(folder or ROOT / "notebooks")
    build = pathlib.Path(build or ROOT / "build")
    cell_timeout = CELL_TIMEOUT_S[size()] if cell_timeout is None else cell_timeout
    cell_timeout = count("cell_timeout", cell_timeout)       # seconds
    paths = select(names, folder)                  # a bad name fails here, before any notebook runs
    reg = registry()
    executed_dir, html_dir = build / "executed", build / "html"
    executed_dir.mkdir(parents=True, exist_ok=True)
    html_dir.mkdir(parents=True, exist_ok=True)
    status_file = html_dir / "status.json"
    status = json.loads(status_file.read_text()) if status_file.exists() else {}
    status = {stem: {**st, "status": f"not run this time (last: {st['status']})"}
              if not st["status"].startswith("not run") else st for stem, st in status.items()}
    for p in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        status.setdefault(p.stem, {"status": "not run yet", "seconds": None})
    t_all = time.time()
    for i, path in enumerate(paths, 1):
        log(f"[{i}/{len(paths)}] {path.name} at size {size()} ...")
        nb, text, seconds = _execute(path, cell_timeout, log)
        log(f"    {text} ({seconds:.0f} s; {time.time() - t_all:.0f} s since the start)")
        status[path.stem] = {"status": text,
                             "seconds": round(seconds, 1), "when": datetime.datetime.now().isoformat(" ", "minutes")}
        nbformat.write(nb, executed_dir / path.name)
        body, _ = HTMLExporter().from_notebook_node(nb)
        (html_dir / f"{path.stem}.html").write_text(body, encoding="utf-8")
    status = {stem: st for stem, st in status.items() if (folder / f"{stem}.ipynb").exists()}
    status_file.write_text(json.dumps(status, indent=1))
    records = {p.stem: json.loads(p.read_text()) for p in RECORDS_DIR.glob("*.json")}
    on_gpus = gpu_records(GPU_DIR)
    cols = machines(records, on_gpus, reg)
    secs = sections(status, folder, build, reg, cols, gpu_runs(on_gpus, folder))
    (html_dir / "index.html").write_text(page(secs, cols, this_machine()), encoding="utf-8")
    log(f"open {html_dir / 'index.html'}  ({(time.time() - t_all) / 60:.1f} min)")
    return 0 if all(status[p.stem]["status"].startswith("ok") for p in paths) else 1
