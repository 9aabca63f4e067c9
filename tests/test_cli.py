import json

import nbformat

from labkit.cli import index_html, main, notebook_meta, readiness, strip_solutions, student


def test_doctor_lists_notebooks(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "00_start_here.ipynb" in out and "features:" in out and "Versions against the lock" in out


def test_doctor_names_a_planted_mismatch(tmp_path, capsys):
    from importlib.metadata import version
    lock = tmp_path / "lock.txt"
    lock.write_text(f"# planted\ntorch=={version('torch').split('+')[0]}\ntransformers==0.0.1\nbitsandbytes==0.0.1\n"
                    "safetensors==0.0.1\npytest==0.0.1\nnot-a-package==1.0\n")
    assert main(["doctor", "--lock", str(lock)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if "may affect:" in line}
    assert set(rows) == {"transformers", "bitsandbytes", "safetensors", "pytest", "not-a-package"}  # torch agrees
    assert "lock 0.0.1" in rows["transformers"] and rows["transformers"].endswith("may affect: all notebooks")
    assert rows["bitsandbytes"].endswith("may affect: 06_quantization_qlora.ipynb")
    assert rows["safetensors"].endswith("may affect: all notebooks (through transformers)")
    assert "(make test), not the notebooks" in rows["pytest"] and "missing" in rows["not-a-package"]
    assert "5 of 6 differ" in out


def test_doctor_diagnoses_a_bad_size(monkeypatch, capsys):
    import os
    monkeypatch.setenv("LABKIT_SIZE", "huge")
    assert main(["doctor"]) == 1                       # a clear line, not a traceback
    out = capsys.readouterr().out
    assert out.startswith("PROBLEM: LABKIT_SIZE must be one of ('tiny', 'full'), got 'huge'. Unset it")
    assert "Notebooks here:" in out and os.environ["LABKIT_SIZE"] == "huge"


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


def test_estimate_takes_a_config_json(tmp_path, capsys):
    import labkit as lk
    path = tmp_path / "config.json"
    path.write_text(lk.models.family_config("mistral-7b", "full").to_json_string())
    assert main(["estimate", str(path), "--seq", "1024", "--train", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "mistral" in out and "config.json" in out and "formula" in out and "optimizer" in out
    assert main(["estimate", "t5-base", "--size", "tiny", "--seq", "32"]) == 0
    assert "fake" in capsys.readouterr().out                        # no formula: measured on fake tensors
    import pytest
    with pytest.raises(SystemExit):
        main(["estimate", str(tmp_path / "nothing.json")])
    with pytest.raises(SystemExit):
        main(["estimate", "llama-2-7b", "--seq", "9000"])             # beyond max_position_embeddings
