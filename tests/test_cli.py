import json

import nbformat

from labkit.cli import index_html, main, notebook_meta, readiness, strip_solutions, student


def test_doctor_lists_notebooks(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "00_start_here.ipynb" in out and "features:" in out


def test_readiness():
    assert readiness({"requires": ["transformers"], "optional": {}}) == ("full", [])
    verdict, reasons = readiness({"requires": [], "optional": {"tensorrt": "the TensorRT engine"}})
    assert verdict == "partly" and reasons == ["without tensorrt: skips the TensorRT engine"]
    assert readiness({"requires": ["tensorrt"]})[0] == "no"
    assert set(notebook_meta()) >= {"00_start_here.ipynb", "01_memory_anatomy.ipynb"}


def test_strip_solutions():
    src = "x = 1\n    ### BEGIN SOLUTION\n    y = secret()\n    ### END SOLUTION\nprint(y)"
    out = strip_solutions(src)
    assert "secret" not in out and "    raise NotImplementedError()" in out and out.endswith("print(y)")
    import pytest
    with pytest.raises(ValueError, match="without"):
        strip_solutions("### BEGIN SOLUTION\nx")


def test_student_versions(tmp_path):
    student(dest=tmp_path)
    for path in tmp_path.glob("*.ipynb"):
        text = "".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        assert "### BEGIN SOLUTION" not in text and "NotImplementedError" in text


def test_index_html_lists_figures():
    html = index_html({"01_x": {"size": "tiny", "device": "cpu", "figures": {"peak_bytes": 2**30, "gap_ratio": 0.5}}},
                      {"01_x.ipynb": "ok in 3 s"})
    assert "01_x.html" in html and "1.00 GiB" in html and "0.5x" in html and "tiny on cpu" in html
    assert "+1.50%" in index_html({"01_x": {"figures": {"estimate_gap": 0.015}}}, {"01_x.ipynb": "ok"})
    assert "79.3%" in index_html({"01_x": {"figures": {"waste_share": 0.793}}}, {"01_x.ipynb": "ok"})
