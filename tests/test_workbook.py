"""`make workbook`'s page (labkit.workbook): labels, units, published figures and their gaps, a column per
machine, a failed notebook, and the run itself (a hung cell, a dead kernel, a subset, no Jupyter noise)."""
import ast
import json
import pathlib
import re

import nbformat
import pytest

from labkit import workbook as wb

ROOT = pathlib.Path(__file__).resolve().parents[1]
REG = {"notebooks": {"01_x": {"teaches": "Where the bytes go."}},
       "figures": {"01_x": {"peak_bytes": {"label": "Peak of one step"},
                            "per_param": {"label": "Model states per parameter", "unit": "bytes/param",
                                          "published": 16, "source": "ZeRO sec. 3.1", "size": "any"},
                            "waste_share": {"label": "KV wasted", "published": [0.6, 0.8], "source": "vLLM",
                                            "size": "any"},
                            "speed_ratio": {"label": "Speed-up", "published": [2, 3], "source": "AMP recipe",
                                            "size": "full"},
                            "flash.fwd_tflops": {"label": "Flash forward TFLOP/s"}}},
       "gpu_checks": {"flash": "01_x"}}
RECORDS = {"01_x": {"size": "tiny", "device": "cpu", "when": "2026-12-02T01:00:00",
                    "figures": {"peak_bytes": 2**30, "per_param": 18, "waste_share": 0.5, "speed_ratio": 0.9,
                                "extra_thing_s": 2.5}}}
GPU = [{"gpu": "NVIDIA H200", "date": "2026-12-03T10:00:00", "check": "01_x", "torch": "2.11",
        "peak_bytes": 3 * 2**30, "speed_ratio": 2.5},
       {"gpu": "NVIDIA H200", "date": "2026-12-03T10:05:00", "check": "flash", "torch": "2.11", "fwd_tflops": 512.0},
       {"gpu": "NVIDIA H200", "date": "2026-12-03T10:06:00", "check": "flash", "torch": "2.11", "status": "failed",
        "error": "boom"}]


def _page(tmp_path, status=None):
    cols = wb.machines(RECORDS, GPU, REG)
    status = status or {"01_x": {"status": "ok", "seconds": 12}, "02_y": {"status": "FAILED after 3 s: "
                        "its kernel died", "seconds": 3}}
    secs = wb.sections(status, tmp_path, tmp_path, REG, cols)
    return wb.page(secs, cols, "a test machine"), secs, cols


def test_the_page_shows_labels_units_published_figures_and_gaps(tmp_path):
    html, secs, cols = _page(tmp_path)
    assert [c["name"] for c in cols] == ["this CPU", "NVIDIA H200"]
    assert "tiny, 2026-12-02" in html and "full, 2026-12-03" in html
    rows = {r["key"]: r for r in secs[0]["rows"]}
    assert rows["peak_bytes"]["values"] == ["1.00 GiB", "3.00 GiB"]
    assert rows["per_param"]["unit"] == "bytes/param" and rows["per_param"]["published"] == "16"
    assert rows["per_param"]["gap"] == "+12% (this CPU)"          # 18 against 16
    assert rows["waste_share"]["published"] == "60.0% to 80.0%"
    assert rows["waste_share"]["gap"] == "-17% (this CPU)"        # 0.5 is 17% below 0.6
    # A full-size figure is compared only with a full-size run: the GPU's 2.5x is inside 2-3x.
    assert rows["speed_ratio"]["gap"] == "+0% (NVIDIA H200)"
    assert rows["flash.fwd_tflops"]["values"] == ["not measured", "512"]   # a GPU check, in its notebook
    assert rows["extra_thing_s"]["label"] == "Extra thing" and rows["extra_thing_s"]["unit"] == "seconds"
    assert rows["flash.fwd_tflops"]["label"] == "Flash forward TFLOP/s"
    assert wb.label("01_x", "bandwidth.pinned_gbps", REG) == "Pinned gbps (GPU check 'bandwidth')"
    assert "ZeRO sec. 3.1" in html and "Where the bytes go." in html and "a test machine" in html
    assert "boom" not in html                                               # a failed GPU run shows no figure
    assert "FAILED after 3 s: its kernel died" in html and "1 failed" in html and "(02_y)" in html


def test_a_figure_no_machine_measured_says_so_and_no_raw_name_is_shown(tmp_path):
    html, secs, _ = _page(tmp_path)
    text = re.sub(r"<[^>]+>", " ", html.split("</style>", 1)[1])
    assert "not measured" in text
    names = {k for rec in RECORDS.values() for k in rec["figures"]} | set(REG["figures"]["01_x"])
    assert not [n for n in names if re.search(rf"\b{re.escape(n)}\b", text)]


def test_the_page_says_which_notebooks_a_gpu_has_passed_at_full_size(tmp_path):
    """`make test-gpu`'s records: the latest run of each notebook on each GPU, passed or not, its minutes and
    peak against the fence, and whether it ran the notebook as it is now (by its hash)."""
    import hashlib
    for stem in ("01_x", "02_y"):
        nbformat.write(nbformat.v4.new_notebook(), tmp_path / f"{stem}.ipynb")
    sha = hashlib.sha256((tmp_path / "01_x.ipynb").read_bytes()).hexdigest()[:12]
    runs = [{"gpu": "NVIDIA H200", "date": "2026-12-03T10:00:00Z", "check": "test-gpu:01_x", "torch": "2.11",
             "status": "failed", "seconds": 60, "failed": "Cell 4: AssertionError: the fence"},
            {"gpu": "NVIDIA H200", "date": "2026-12-03T11:00:00Z", "check": "test-gpu:01_x", "torch": "2.11",
             "status": "ok", "seconds": 84, "peak_reserved_bytes": 12 * 2**30, "fence_bytes": 22 * 2**30,
             "notebook_sha": sha},
            {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-04T10:00:00Z", "check": "test-gpu:01_x", "torch": "2.11",
             "status": "ok", "seconds": 90, "notebook_sha": "an-old-one"}]
    found = wb.gpu_runs(GPU + runs, tmp_path)
    assert [(r["gpu"], r["status"], r["current"]) for r in found["01_x"]] == [
        ("NVIDIA H100 80GB HBM3", "ok", False), ("NVIDIA H200", "ok", True)]
    cols = wb.machines(RECORDS, GPU + runs, REG)
    assert all(not k[1].startswith("peak_reserved") for c in cols for k in c["figures"])   # no figure row of its own
    status = {"01_x": {"status": "ok", "seconds": 12}, "02_y": {"status": "ok", "seconds": 3}}
    html = wb.page(wb.sections(status, tmp_path, tmp_path, REG, cols, found), cols, "a test machine")
    assert "passed on NVIDIA H200 (2026-12-03, 1.4 min, peak 12.00 GiB of 22.00 GiB)" in html
    assert "passed on NVIDIA H100 80GB HBM3 (2026-12-04, 1.5 min, an earlier version of this notebook)" in html
    assert "At full size on NVIDIA H200: <b>1</b> of 2 notebooks passed" in html
    assert "At full size on NVIDIA H100 80GB HBM3: <b>0</b> of 2" in html
    assert "At full size: not run on a GPU yet" in html                     # 02_y


def test_gaps_to_published_figures():
    assert wb.published_gap(18, 16) == pytest.approx(0.125)
    assert wb.published_gap(0.7, [0.6, 0.8]) == 0.0
    assert wb.published_gap(0.9, [0.6, 0.8]) == pytest.approx(0.125)
    assert wb.published_gap("n/a", 16) is None and wb.published_gap(3, None) is None


def test_every_figure_the_notebooks_record_has_a_label():
    """The registry labels every figure a notebook passes to lk.record by name (data/workbook.json)."""
    reg, missing = wb.registry(), []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code" or "record(" not in cell.source:
                continue
            for node in ast.walk(ast.parse(cell.source)):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "record":
                    missing += [f"{path.stem}: {k.arg}" for k in node.keywords
                                if k.arg and k.arg not in reg["figures"].get(path.stem, {})]
    assert not missing, f"add a label to data/workbook.json for: {missing}"
    stems = {p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert stems <= set(reg["notebooks"]), f"no 'teaches' line for {sorted(stems - set(reg['notebooks']))}"
    for entries in reg["figures"].values():
        for key, entry in entries.items():
            assert entry.get("label"), key
            assert ("published" in entry) == bool(entry.get("source")), f"{key}: a published figure names its source"


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {path.stem[:2]} · A title")] + \
               [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


PLOT = ("import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()")


def test_the_run_survives_a_hung_cell_and_a_dead_kernel_and_runs_a_subset(tmp_path, capfd, monkeypatch):
    src, build = tmp_path / "notebooks", tmp_path / "build"
    src.mkdir()
    _notebook(src / "00_hangs.ipynb", "import time\ntime.sleep(600)")
    _notebook(src / "01_dies.ipynb", "import os\nos._exit(1)")
    _notebook(src / "02_plots.ipynb", PLOT, "print('Skipped: the GPU part. It needs cuda, which this machine does not have.')")
    monkeypatch.setattr(wb, "REGISTRY", tmp_path / "reg.json")
    (tmp_path / "reg.json").write_text(json.dumps({"notebooks": {}, "figures": {}, "gpu_checks": {}}))
    lines = []
    assert wb.run(None, src, build, cell_timeout=30, log=lines.append) == 1
    index = (build / "html" / "index.html").read_text()
    assert "a cell ran past 30 s" in index and "its kernel died" in index and "2 failed" in index
    assert "Skipped: the GPU part" in index and "data:image/png;base64," in index and 'href="02_plots.html"' in index
    assert any(l.startswith("[3/3] 02_plots.ipynb") for l in lines)
    assert "without encryption" not in capfd.readouterr().err          # the kernel's own log stays quiet
    # A subset: only 02 runs; the others keep their last status, and the exit status is 02's.
    lines.clear()
    assert wb.run(["02"], src, build, cell_timeout=30, log=lines.append) == 0
    index = (build / "html" / "index.html").read_text()
    assert "not run this time (last: FAILED" in index and len([l for l in lines if l.startswith("[")]) == 1
    with pytest.raises(ValueError, match=r"notebooks: '7' names no notebook .* there are 00, 01, 02"):
        wb.run(["7"], src, build)
