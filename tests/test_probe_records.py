"""A hostile caller's probe of labkit.records.gpu_figures / show_gpu (each test once failed)."""
import json

import pytest

from labkit import records


def _line(**fields):
    return json.dumps({"gpu": "NVIDIA H200", "date": "2026-12-02T10:00:00Z", "check": "flash",
                       "torch": "2.11.0", **fields}) + "\n"


def test_a_misspelt_key_is_an_error_naming_the_figures_there_are(tmp_path):
    (tmp_path / "h200.jsonl").write_text(_line(fwd_tflops=412.5))
    with pytest.raises(ValueError, match=r"keys \['fwd_tflop'\] are in no record of 'flash'; its figures are \['fwd_tflops'\]"):
        records.show_gpu("flash", ["fwd_tflop"], folder=tmp_path)


def test_keys_may_be_any_iterable_of_names_read_once(tmp_path, capsys):
    (tmp_path / "h200.jsonl").write_text(_line(fwd_tflops=412.5))
    records.show_gpu("flash", (k for k in ["fwd_tflops"]), folder=tmp_path)
    assert capsys.readouterr().out.endswith("flash: fwd_tflops 412.5\n")


def test_a_record_without_figures_says_so(tmp_path, capsys):
    (tmp_path / "h200.jsonl").write_text(_line())
    records.show_gpu("flash", folder=tmp_path)
    assert capsys.readouterr().out.endswith("flash: (no one-number figures in this record)\n")


def test_a_bad_folder_or_a_bad_field_is_an_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="folder must be a path .*got 3"):
        records.gpu_figures("flash", folder=3)
    (tmp_path / "a.jsonl").write_text(_line())
    with pytest.raises(ValueError, match="folder must be a folder .*got the file"):
        records.gpu_figures("flash", folder=tmp_path / "a.jsonl")
    (tmp_path / "a.jsonl").write_text(_line(date=5))
    with pytest.raises(ValueError, match=r"a.jsonl:1 is not a GPU record: date must be text"):
        records.gpu_figures("flash", folder=tmp_path)
    (tmp_path / "a.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError, match=r"a.jsonl is not UTF-8 text"):
        records.gpu_figures("flash", folder=tmp_path)


def test_the_no_record_line_names_the_folder_it_read_and_any_failed_runs(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text(_line(status="failed", error="CUDA error"))
    assert records.show_gpu("flash", folder=tmp_path) == []
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and str(tmp_path) in out and "1 failed or skipped run(s)" in out
