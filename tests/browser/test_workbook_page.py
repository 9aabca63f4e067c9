"""`make workbook`'s page in a real browser: built by labkit.workbook.run from two small notebooks (one
plots, one records figures) and a GPU record, opened from a file:// URL in the system's Chromium, light and
dark. Every image loads, no figure's raw snake_case name is shown, and screenshots go to build/browser/."""
import json
import os
import pathlib
import re
import shutil

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHOTS = ROOT / "build" / "browser"
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

playwright = pytest.importorskip("playwright.sync_api", reason="make test-browser installs playwright")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no browser at {CHROMIUM}: `apt-get install -y chromium` (Debian) or CHROMIUM=/path/to/chrome",
                allow_module_level=True)

PLOT = ("import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.title('a plot')\nplt.show()")


def _notebook(path, title, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}")] + [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """index.html from a real run of labkit.workbook over two notebooks, with the project's registry."""
    from labkit import records, workbook
    tmp = tmp_path_factory.mktemp("workbook")
    src, build, recs, gpu = tmp / "notebooks", tmp / "build", tmp / "records", tmp / "gpu"
    for d in (src, recs, gpu):
        d.mkdir()
    # Names of real notebooks, so the project's labels (data/workbook.json) are the ones shown.
    record = ("import labkit as lk\nlk.record('02_mixed_precision', fp32_peak_bytes=3 * 2**20, "
              "amp_activation_ratio=0.64, amp_bf16_speed_ratio=0.93)")
    _notebook(src / "02_mixed_precision.ipynb", "02 · Mixed precision (a stand-in)", PLOT, record)
    _notebook(src / "08_flash_attention.ipynb", "08 · FlashAttention (a stand-in)",
              "print('Skipped: the Triton kernel. It needs triton, which this machine does not have.')")
    (gpu / "h200.jsonl").write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-12-03T10:00:00",
                                                "check": "flash", "torch": "2.11", "fwd_tflops": 512.5}) + "\n")
    old = os.environ.get("LABKIT_RECORDS")
    os.environ["LABKIT_RECORDS"] = str(recs)          # the notebooks' kernels inherit it
    mp = pytest.MonkeyPatch()
    mp.setattr(records, "RECORDS_DIR", recs)
    mp.setattr(records, "GPU_DIR", gpu)
    try:
        assert workbook.run(None, src, build, cell_timeout=120) == 0
    finally:
        mp.undo()
        os.environ.pop("LABKIT_RECORDS") if old is None else os.environ.__setitem__("LABKIT_RECORDS", old)
    return build / "html" / "index.html", json.loads((recs / "02_mixed_precision.json").read_text())


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_workbook_page_loads_every_image_and_shows_no_raw_names(built, scheme):
    index, rec = built
    SHOTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000}, color_scheme=scheme)
        requests = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(index.as_uri(), wait_until="load")
        images = page.eval_on_selector_all("img", "els => els.map(e => [e.complete, e.naturalWidth])")
        assert images and all(done and width > 0 for done, width in images), images
        text = page.inner_text("body")
        assert "Peak, fp32" in text and "3.00 MiB" in text and "NVIDIA H200" in text and "512.5" in text
        assert "Skipped: the Triton kernel" in text and "not measured" in text
        raw = [k for k in rec["figures"] if re.search(rf"\b{k}\b", text)] + \
              [w for w in re.findall(r"\b[a-z0-9]+(?:_[a-z0-9]+)+\b", text) if w not in ("x86_64",)]   # the machine line
        assert not raw, f"raw figure names on the page: {raw}"
        assert all(u.startswith(("file:", "data:")) for u in requests), requests   # self-contained
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert (background == "rgb(255, 255, 255)") == (scheme == "light"), background
        page.screenshot(path=str(SHOTS / f"workbook_{scheme}.png"), full_page=True)
        browser.close()
