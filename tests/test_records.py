"""labkit.records: lk.record's figures (values kept, standard JSON, a corrupted file set aside) and the GPU records
of data/gpu/ (read, shown with their GPU and date, refused naming the file, line, key or folder), and the
published figures of data/published.csv."""
import json
import pathlib
from fractions import Fraction

import numpy as np
import pytest
import torch

import labkit as lk
from labkit import records
from labkit.units import fmt_figure


@pytest.fixture
def where(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RECORDS_DIR", tmp_path)
    return tmp_path


def _strict(path):
    """Standard JSON only: NaN or Infinity in the file fail here."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_numbers_keep_their_value(where):
    path = lk.record("99_test", half=np.float32(2.5), third=Fraction(1, 3), n=np.int64(7), t=torch.tensor(0.25),
                     peak_bytes=1024, name="fp32")
    figures = _strict(path)["figures"]
    assert figures == {"half": 2.5, "third": pytest.approx(1 / 3), "n": 7, "t": 0.25, "peak_bytes": 1024, "name": "fp32"}
    assert isinstance(figures["n"], int) and isinstance(figures["peak_bytes"], int)


def test_nan_and_inf_are_standard_json_and_the_index_shows_them(where):
    path = lk.record("99_test", loss_gap=float("nan"), time_s=float("inf"), peak_bytes=np.float64("-inf"))
    figures = _strict(path)["figures"]
    assert figures == {"loss_gap": "nan", "time_s": "inf", "peak_bytes": "-inf"}
    assert [fmt_figure(k, v) for k, v in figures.items()] == ["nan", "inf", "-inf"]    # the workbook index


def test_a_corrupted_record_is_set_aside_and_replaced(where, capsys):
    (where / "99_test.json").write_text('{"size": "tiny", "figures": {"a": 1')    # cut short
    path = lk.record("99_test", b=2)
    assert _strict(path)["figures"] == {"b": 2}
    kept = list(where.glob("99_test.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_text().startswith('{"size"')
    assert "is not valid JSON" in capsys.readouterr().out
    lk.record("99_test", c=3)                                                       # merged as before
    assert _strict(path)["figures"] == {"b": 2, "c": 3}


def test_bad_figures_name_the_figure(where):
    with pytest.raises(TypeError, match="figure flag must be a number or a string, got True"):
        lk.record("99_test", flag=True)
    with pytest.raises(TypeError, match="figure v must be"):
        lk.record("99_test", v=[1, 2])
    with pytest.raises(ValueError, match="notebook must be a name like"):
        lk.record("notebook", a=1)


# GPU records: data/gpu/<gpu>.jsonl, one line per check and run of `make gpu-smoke`.

def _gpu_line(check, date, gpu="NVIDIA H200", **figures):
    return json.dumps({"gpu": gpu, "date": date, "check": check, "torch": "2.11.0+cu128", **figures}) + "\n"


def test_gpu_figures_returns_one_checks_records_oldest_first(tmp_path):
    (tmp_path / "NVIDIA_H200.jsonl").write_text(
        _gpu_line("flash", "2026-12-02T10:00:00Z", status="ok", fwd_tflops=412.5)
        + _gpu_line("tf32", "2026-12-02T10:01:00Z", status="ok", tf32_ratio=6.1)
        + "\n"
        + _gpu_line("flash", "2026-12-01T09:00:00Z", status="ok", fwd_tflops=400.0))
    (tmp_path / "NVIDIA_L4.jsonl").write_text(
        _gpu_line("flash", "2026-12-03T08:00:00Z", gpu="NVIDIA L4", status="failed", error="RuntimeError: x"))
    recs = records.gpu_figures("flash", folder=tmp_path)
    assert [r["fwd_tflops"] for r in recs] == [400.0, 412.5]          # the failed L4 run is left out
    assert all({"gpu", "date", "check", "torch"} <= set(r) for r in recs)
    every = records.gpu_figures("flash", folder=tmp_path, failed=True)
    assert [r["gpu"] for r in every] == ["NVIDIA H200", "NVIDIA H200", "NVIDIA L4"]


def test_show_gpu_labels_each_figure_with_the_gpu_and_the_date(tmp_path, capsys):
    (tmp_path / "NVIDIA_H200.jsonl").write_text(
        _gpu_line("flash", "2026-12-02T10:00:00Z", status="ok", seconds=3.2, fwd_tflops=412.5, peak_bytes=2**30))
    recs = records.show_gpu("flash", folder=tmp_path)
    out = capsys.readouterr().out
    assert out == "NVIDIA H200, 2026-12-02 (torch 2.11.0+cu128), flash: fwd_tflops 412.5, peak_bytes 1.00 GiB\n"
    assert recs[0]["fwd_tflops"] == 412.5
    records.show_gpu("flash", ["peak_bytes", "fwd_tflops"], folder=tmp_path)    # chosen figures, in that order
    assert capsys.readouterr().out == ("NVIDIA H200, 2026-12-02 (torch 2.11.0+cu128), flash: peak_bytes 1.00 GiB, "
                                       "fwd_tflops 412.5\n")
    with pytest.raises(TypeError, match="keys must be a list of figure names"):
        records.show_gpu("flash", "peak_bytes", folder=tmp_path)


def test_a_misspelt_key_is_an_error_naming_the_figures_there_are(tmp_path):
    (tmp_path / "h200.jsonl").write_text(_gpu_line("flash", "2026-12-02T10:00:00Z", fwd_tflops=412.5))
    with pytest.raises(ValueError, match=r"keys \['fwd_tflop'\] are in no record of 'flash'; its figures are \['fwd_tflops'\]"):
        records.show_gpu("flash", ["fwd_tflop"], folder=tmp_path)


def test_keys_may_be_any_iterable_of_names_read_once(tmp_path, capsys):
    (tmp_path / "h200.jsonl").write_text(_gpu_line("flash", "2026-12-02T10:00:00Z", fwd_tflops=412.5))
    records.show_gpu("flash", (k for k in ["fwd_tflops"]), folder=tmp_path)
    assert capsys.readouterr().out.endswith("flash: fwd_tflops 412.5\n")


def test_a_record_without_figures_says_so(tmp_path, capsys):
    (tmp_path / "h200.jsonl").write_text(_gpu_line("flash", "2026-12-02T10:00:00Z"))
    records.show_gpu("flash", folder=tmp_path)
    assert capsys.readouterr().out.endswith("flash: (no one-number figures in this record)\n")


def test_show_gpu_says_in_one_line_that_no_record_exists_yet(tmp_path, capsys):
    assert records.show_gpu("tf32", folder=tmp_path / "absent") == []
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "No GPU record of the check 'tf32'" in out and "make gpu-smoke" in out
    records.show_gpu("test-gpu:13_capstone_fit_what_does_not_fit", folder=tmp_path / "absent")
    assert "`make test-gpu` on a CUDA GPU writes one" in capsys.readouterr().out      # make test-gpu's records


def test_the_no_record_line_names_the_folder_it_read_and_any_failed_runs(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text(_gpu_line("flash", "2026-12-02T10:00:00Z", status="failed", error="CUDA error"))
    assert records.show_gpu("flash", folder=tmp_path) == []
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and str(tmp_path) in out and "1 failed or skipped run(s)" in out


def test_gpu_check_names_are_validated_before_any_file_is_read(tmp_path):
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="check must be one of test_gpu, allocator, flash.*got 'flsh'"):
        records.gpu_figures("flsh", folder=tmp_path)
    with pytest.raises(ValueError, match="got ''"):
        records.show_gpu("", folder=tmp_path)
    with pytest.raises(TypeError, match="check must be the name of a GPU check"):
        records.gpu_figures(None, folder=tmp_path)


def test_a_broken_gpu_record_names_its_file_and_line(tmp_path):
    (tmp_path / "x.jsonl").write_text(_gpu_line("flash", "2026-12-02T10:00:00Z") + '{"gpu": "A"\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2 is not a JSON line"):
        records.gpu_figures("flash", folder=tmp_path)
    (tmp_path / "x.jsonl").write_text('{"gpu": "A", "check": "flash"}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:1 is not a GPU record: it lacks date, torch"):
        records.gpu_figures("flash", folder=tmp_path)


def test_a_bad_folder_or_a_bad_field_is_an_error_naming_it(tmp_path):
    with pytest.raises(TypeError, match="folder must be a path .*got 3"):
        records.gpu_figures("flash", folder=3)
    (tmp_path / "a.jsonl").write_text(_gpu_line("flash", "2026-12-02T10:00:00Z"))
    with pytest.raises(ValueError, match="folder must be a folder .*got the file"):
        records.gpu_figures("flash", folder=tmp_path / "a.jsonl")
    (tmp_path / "a.jsonl").write_text(_gpu_line("flash", 5))
    with pytest.raises(ValueError, match=r"a.jsonl:1 is not a GPU record: date must be text"):
        records.gpu_figures("flash", folder=tmp_path)
    (tmp_path / "a.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError, match=r"a.jsonl is not UTF-8 text"):
        records.gpu_figures("flash", folder=tmp_path)


def test_the_committed_gpu_records_are_readable_and_name_known_checks():
    """Every line in data/gpu/ (what `make gpu-smoke` appended and was committed) parses and names a check."""
    for path, number, rec in records._lines(records.GPU_DIR):
        assert rec["check"] in {**records.GPU_CHECKS, **records.GPU_RUNS}, f"{path}:{number} names an unknown check {rec['check']!r}"
        assert rec.get("status", "ok") in {"ok", "failed", "skipped"}, f"{path}:{number}"


def test_gpu_records_are_found_in_a_checkout():
    import labkit
    root = pathlib.Path(labkit.__file__).resolve().parent.parent
    if (root / "data" / "corpus.txt").exists():                 # a checkout, not an installed wheel
        assert records.GPU_DIR == root / "data" / "gpu"


def test_published_figures_print_their_source_and_each_quote_once(capsys):
    from labkit.records import published
    low, high = published("vllm-prior-used-low", "vllm-prior-used-high")
    out = capsys.readouterr().out
    assert (low, high) == (20.4, 38.2) and out.count("published:") == 2 and out.count("only 20.4% - 38.2%") == 1
    assert published("vllm-default-block-size", quote=False) == 16.0
    assert '"' not in capsys.readouterr().out
    with pytest.raises(ValueError, match="key 'palm-540b-param' is not an id of data/published.csv .*palm-540b-params"):
        published("palm-540b-param")
    with pytest.raises(TypeError, match="got none"):
        published()
