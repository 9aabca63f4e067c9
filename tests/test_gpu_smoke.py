"""`make gpu-smoke` and validate_allocator, tested on a CPU up to where they need CUDA.

What runs here: the exit-2 path without a GPU or with bad arguments, the record writer, the check registry,
the worker protocol with its deadlines (toy checks that succeed, overrun, raise, skip and die), the pure-Python
parts of the checks, tests/test_gpu.py read through its junit report, and validate_allocator's parent/child protocol
with children that are the model itself (and one that raises).
"""
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from labkit import records
from labkit.scripts import gpu_smoke as smoke
from labkit.scripts import validate_allocator as va

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0"}


# ---- without CUDA ---------------------------------------------------------------------------------
def test_without_cuda_it_says_so_writes_nothing_and_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "LABKIT_GPU_RECORDS": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "labkit.scripts.gpu_smoke"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "gpu-smoke needs a CUDA GPU" in run.stderr and "Nothing was measured or written" in run.stderr
    assert run.stdout == "" and list(tmp_path.iterdir()) == []


def test_validate_allocator_without_cuda_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert va.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ---- bad arguments: exit status 2 and a message naming the flag and the value, before CUDA is asked ---------
@pytest.mark.parametrize("argv, says", [
    (["--budget", "0"], "--budget must be a positive number of seconds, got 0.0"),
    (["--budget", "-1"], "--budget must be a positive number of seconds, got -1.0"),
    (["--budget", "nan"], "--budget must be a positive number of seconds, got nan"),
    (["--only", "flash,nope"], "--only names unknown checks ['nope']"),
    (["--only", ","], "--only must name checks"),
])
def test_gpu_smoke_refuses_bad_arguments_before_looking_for_cuda(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(smoke, "cuda_env", lambda: pytest.fail("CUDA was asked about before the arguments"))
    with pytest.raises(SystemExit) as e:
        smoke.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_gpu_smoke_refuses_an_out_folder_it_cannot_write(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(smoke, "cuda_env", lambda: pytest.fail("CUDA was asked about before the arguments"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out, says in ((blocker, "it is a file, not a folder"), (blocker / "sub", "is a file, not a folder")):
        with pytest.raises(SystemExit) as e:
            smoke.main(["--out", str(out)])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert records.unwritable(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv, says", [
    (["--layers", "0"], "--layers must be a positive number of decoder layers, got 0"),
    (["--jobs", "-2"], "--jobs must be a positive number of children at a time, got -2"),
])
def test_validate_allocator_refuses_bad_counts(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        va.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_validate_allocator_refuses_an_out_path_it_cannot_write_before_the_gpu_run(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        va.main(["--out", str(blocker / "x.json")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err


# ---- the registry ---------------------------------------------------------------------------------
def test_every_check_has_a_name_a_function_a_deadline_and_its_packages():
    assert [c.name for c in smoke.CHECKS] == list(records.GPU_CHECKS)      # same checks, same order
    for c in smoke.CHECKS:
        assert callable(c.fn) and c.fn.__doc__, c.name
        assert isinstance(c.seconds, int) and 0 < c.seconds <= smoke.BUDGET_S, c.name
        assert isinstance(c.needs, tuple) and all(isinstance(m, str) for m in c.needs), c.name
    first = [c.name for c in smoke.CHECKS][:3]
    assert first == ["test_gpu", "allocator", "flash"]                     # most valuable first


def test_the_whole_command_is_budgeted_to_five_minutes_from_its_start():
    assert smoke.BUDGET_S == 300
    fixed = [c for c in smoke.CHECKS if c.name not in records.NOTEBOOKS]
    assert all(c.seconds + smoke.GRACE_S <= smoke.BUDGET_S / 2 for c in fixed)  # no single check can eat the run
    make = subprocess.run(["make", "-n", "gpu-smoke", "PYTHON=python3"], cwd=ROOT, capture_output=True, text=True)
    assert "--started" in make.stdout, make.stdout                        # make passes the command's start


def test_every_notebook_with_full_steps_has_a_check_13_included():
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert list(records.NOTEBOOKS) == notebooks
    assert [c.name for c in smoke.CHECKS][-1] == "13_capstone_fit_what_does_not_fit"


# ---- the record writer ----------------------------------------------------------------------------
@pytest.mark.parametrize("gpu, name", [("NVIDIA H200", "NVIDIA_H200.jsonl"),
                                       ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3.jsonl"),
                                       ("NVIDIA GeForce RTX 4090 (D)/x", "NVIDIA_GeForce_RTX_4090_D_x.jsonl"),
                                       (" Tesla T4 ", "Tesla_T4.jsonl")])
def test_the_file_is_named_after_the_gpu_in_safe_characters(gpu, name):
    assert smoke.gpu_file_name(gpu) == name


def test_a_gpu_without_a_name_is_refused():
    for bad in ("", "  ", None):
        with pytest.raises(ValueError, match="gpu must be a GPU's name"):
            smoke.gpu_file_name(bad)


def test_records_are_appended_one_line_each_and_read_back_by_gpu_figures(tmp_path):
    smoke.write_record(tmp_path, ENV, "flash", "ok", 12.34, full_fwd_tflops=np.float32(401.5),
                       n=np.int64(4096), err=torch.tensor(1.5e-3), block=64, note="x", detail=[{"a": 1}])
    path, rec = smoke.write_record(tmp_path, ENV, "flash", "failed", 3, error="RuntimeError: boom",
                                   full_fwd_tflops=float("nan"))
    smoke.write_record(tmp_path, ENV, "bnb_4bit", "skipped", 0, reason="bitsandbytes is not installed")
    assert path == tmp_path / "NVIDIA_H200.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["full_fwd_tflops"] == 401.5 and first["n"] == 4096 and isinstance(first["n"], int)
    assert first["err"] == pytest.approx(1.5e-3) and first["detail"] == [{"a": 1}] and first["seconds"] == 12.3
    assert {k: first[k] for k in ("gpu", "check", "torch", "cuda", "status")} == {
        "gpu": "NVIDIA H200", "check": "flash", "torch": "2.11.0+cu130", "cuda": "13.0", "status": "ok"}
    assert first["date"].endswith("Z") and len(first["date"]) == 20          # UTC, to the second
    assert rec["full_fwd_tflops"] == "nan"                                  # standard JSON has no NaN
    ok = records.gpu_figures("flash", folder=tmp_path)
    assert [r["status"] for r in ok] == ["ok"]
    assert [r["status"] for r in records.gpu_figures("flash", folder=tmp_path, failed=True)] == ["ok", "failed"]
    assert records.gpu_figures("bnb_4bit", folder=tmp_path) == []


def test_the_writer_refuses_unknown_checks_statuses_figures_and_clashing_keys(tmp_path):
    with pytest.raises(ValueError, match="check must be one of test_gpu"):
        smoke.write_record(tmp_path, ENV, "flsh", "ok", 1)
    with pytest.raises(ValueError, match="status must be 'ok', 'failed' or 'skipped', got 'good'"):
        smoke.write_record(tmp_path, ENV, "flash", "good", 1)
    with pytest.raises(ValueError, match=r"must not reuse the record's own keys, got \['gpu'\]"):
        smoke.write_record(tmp_path, ENV, "flash", "ok", 1, gpu="other")
    with pytest.raises(TypeError, match="figure x must be one number"):
        smoke.write_record(tmp_path, ENV, "flash", "ok", 1, x=torch.ones(3))
    with pytest.raises(TypeError, match="figure y must be a number, a string"):
        smoke.write_record(tmp_path, ENV, "flash", "ok", 1, y=object())
    assert list(tmp_path.iterdir()) == []                                   # nothing half-written


# ---- the worker, one check in this process -----------------------------------------------------------
def _ok(ctx):
    """A toy check that measures something."""
    return {"x_tflops": 1.5, "left_s": ctx.left()}


def _skips(ctx):
    """A toy check that cannot run here."""
    raise smoke.Skip("no graphs on this toy")


def _raises(ctx):
    """A toy check that breaks."""
    raise RuntimeError("toy check broke")


def _finds_a_problem(ctx):
    """A toy check whose measurement misses its bound: failed, its figures kept."""
    return {"err": 0.5, "problems": ["error 0.5 over 1e-3"]}


def test_run_one_gives_each_check_its_deadline_and_records_what_happened():
    until = time.monotonic() + 100
    status, fields = smoke.run_one(smoke.Check("tf32", _ok, 30, ()), until)
    assert status == "ok" and fields["x_tflops"] == 1.5 and 20 < fields["left_s"] <= 30   # its own 30 s
    status, fields = smoke.run_one(smoke.Check("tf32", _ok, 300, ()), until)
    assert 90 < fields["left_s"] <= 100                                                # capped by the budget
    assert smoke.run_one(smoke.Check("tf32", _skips, 30, ()), until) == ("skipped", {"reason": "no graphs on this toy"})
    status, fields = smoke.run_one(smoke.Check("tf32", _raises, 30, ()), until)
    assert status == "failed" and fields["error"] == "RuntimeError: toy check broke"
    assert "Traceback" in fields["traceback"] and "_raises" in fields["traceback"]
    assert smoke.run_one(smoke.Check("tf32", _finds_a_problem, 30, ()), until) == (
        "failed", {"error": "error 0.5 over 1e-3", "err": 0.5})
    status, fields = smoke.run_one(smoke.Check("bnb_4bit", _ok, 30, ("no_such_package_xyz",)), until)
    assert status == "skipped" and "no_such_package_xyz is not installed" in fields["reason"]
    status, fields = smoke.run_one(smoke.Check("tf32", _ok, 30, ()), time.monotonic() + 2)
    assert status == "skipped" and fields["reason"].startswith("out of time")


def test_with_no_time_left_every_check_is_recorded_as_skipped(tmp_path):
    results = smoke.run(["tf32", "flash"], ENV, tmp_path, budget=0, echo=lambda line: None)
    assert [(r[0], r[1]) for r in results] == [("tf32", "skipped"), ("flash", "skipped")]
    assert all("out of time" in json.loads(l)["reason"] for l in (tmp_path / "NVIDIA_H200.jsonl").read_text().splitlines())
    with pytest.raises(ValueError, match="names must be checks of"):
        smoke.run(["nope"], ENV, tmp_path, budget=0)


# ---- the worker protocol, in processes ------------------------------------------------------------------
def test_nothing_runs_past_the_budget_counted_from_the_commands_start(tmp_path, monkeypatch):
    """A check that overruns is killed by the budget's end, grace included: a command that started 4 s
    before run() was called, with a budget of 40 s, is over within those 40 s (the last kill comes at
    40 - 10 s, END_S kept for the summary), not 4 + 40 s plus a check's grace."""
    (tmp_path / "toy_smoke_checks.py").write_text(TOY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(tmp_path))
    started = time.time() - 4
    results = smoke.run(["tf32", "matmul"], ENV, tmp_path / "out", budget=40, registry="toy_smoke_checks:CHECKS",
                        echo=lambda line: None, grace=4, started=started)
    assert time.time() - started < 40
    assert [(r[0], r[1]) for r in results] == [("tf32", "ok"), ("matmul", "failed")]
    assert results[1][3]["error"].startswith("killed: still running")


TOY = '''
import os, time
from labkit.scripts.gpu_smoke import Check

def ok(ctx):
    """succeeds"""
    return {"x_tflops": 2.5}

def overruns(ctx):
    """sleeps past its deadline"""
    print("still working", flush=True)
    time.sleep(120)

def dies(ctx):
    """the process dies under it, as a CUDA fault would take it"""
    print("about to die", flush=True)
    os._exit(7)

CHECKS = [Check("tf32", ok, 30, ()), Check("flash", overruns, 1, ()), Check("bnb_4bit", dies, 30, ()),
          Check("allocator", ok, 30, ()), Check("matmul", overruns, 100, ())]
'''


def test_a_check_that_overruns_is_killed_one_that_dies_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    (tmp_path / "toy_smoke_checks.py").write_text(TOY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(tmp_path))       # the parent reads each check's deadline from the registry too
    said = []
    results = smoke.run(["tf32", "flash", "bnb_4bit", "allocator"], ENV, tmp_path / "out", budget=240,
                        registry="toy_smoke_checks:CHECKS", echo=said.append, grace=1)
    got = {name: (status, fields) for name, status, _, fields in results}
    assert [r[0] for r in results] == ["tf32", "flash", "bnb_4bit", "allocator"]
    assert got["tf32"] == ("ok", {"x_tflops": 2.5}) and got["allocator"] == ("ok", {"x_tflops": 2.5})
    assert got["flash"][0] == "failed" and got["flash"][1]["error"].startswith("killed: still running")
    assert "still working" in got["flash"][1]["output"]
    flash_s = next(s for name, _, s, _ in results if name == "flash")
    assert flash_s < 30                                     # 1 s deadline + 1 s grace, not its 120 s sleep
    assert got["bnb_4bit"][0] == "failed" and "worker process died (exit 7)" in got["bnb_4bit"][1]["error"]
    assert "about to die" in got["bnb_4bit"][1]["output"]
    lines = [json.loads(l) for l in (tmp_path / "out" / "NVIDIA_H200.jsonl").read_text().splitlines()]
    assert [(l["check"], l["status"]) for l in lines] == [("tf32", "ok"), ("flash", "failed"),
                                                           ("bnb_4bit", "failed"), ("allocator", "ok")]
    assert any(line.startswith("[gpu-smoke] flash: failed") for line in said)
    text, status = smoke.summary(results)
    assert status == 1 and "2 of 4 checks ok or skipped; FAILED: flash, bnb_4bit" in text


def test_the_summary_exits_0_when_nothing_failed():
    text, status = smoke.summary([("tf32", "ok", 1.0, {"x": 1}), ("bnb_4bit", "skipped", 0.0, {"reason": "r"})])
    assert status == 0 and "2 of 2 checks ok or skipped" in text and "FAILED" not in text


# ---- the checks' pure-Python parts ----------------------------------------------------------------------
def test_attention_flops_count_two_matmuls_forward_and_five_backward():
    fwd, bwd = smoke.attention_flops(batch=2, heads=3, n=5, d=7, causal=False)
    assert fwd == 2 * (2 * 3 * 5 * 5 * 7) * 2                  # QK^T and PV: n*n*d multiply-adds each, 2 FLOPs
    assert bwd == 2.5 * fwd
    assert smoke.attention_flops(2, 3, 5, 7, causal=True)[0] == fwd / 2


def test_rel_err_is_the_worst_element_over_the_largest_reference():
    ref = torch.tensor([1.0, -4.0, 2.0])
    assert smoke.rel_err(ref + torch.tensor([0.0, 0.0, 0.4]), ref) == pytest.approx(0.1)
    assert smoke.rel_err(ref, ref) == 0


def test_json_safe_keeps_numbers_exact_and_nested_details():
    assert smoke.json_safe({"a": np.float64(0.5), "b": [np.int32(3), True], "c": float("inf")}) == \
        {"a": 0.5, "b": [3, True], "c": "inf"}
    assert isinstance(smoke.json_safe(np.int64(2**40)), int) and smoke.json_safe(2**40) == 2**40


JUNIT = '''<testsuites><testsuite tests="3">
<testcase name="test_track_matches_max_memory_allocated[fp32]"><properties>
  <property name="fp32_track_peak_bytes" value="3221225472"/><property name="fp32_track_gap" value="0.0123"/>
</properties></testcase>
<testcase name="test_budget_raises_a_real_cuda_oom"><properties><property name="budget_oom_raised" value="False"/></properties>
  <failure message="assert False">AssertionError</failure></testcase>
<testcase name="test_snapshot_file"><skipped message="no"/></testcase>
</testsuite></testsuites>'''


def test_junit_figures_count_outcomes_and_keep_recorded_properties():
    figures = smoke.junit_figures(ET.fromstring(JUNIT))
    assert figures == dict(tests=3, passed=1, failed=1, errors=0, skipped=1, fp32_track_peak_bytes=3221225472,
                           fp32_track_gap=0.0123, budget_oom_raised=False,
                           failed_tests="test_budget_raises_a_real_cuda_oom")


def test_the_test_gpu_check_runs_pytest_and_reads_its_report(tmp_path):
    """On a CPU every test of tests/test_gpu.py is skipped: the check's own path (pytest, junit XML,
    figures) runs for real all the same."""
    figures = smoke.check_test_gpu(smoke.Context(time.monotonic() + 300, ROOT))
    assert figures["tests"] == 4 and figures["skipped"] == 4 and figures["failed"] == 0
    assert "problems" not in figures
    with pytest.raises(smoke.Skip, match="is not here"):
        smoke.check_test_gpu(smoke.Context(time.monotonic() + 300, tmp_path))


def test_allocator_figures_summarise_the_rows():
    rows = [dict(trace="growing_batch", conf="default", real_peak_reserved=100, model_peak_reserved=100,
                 real_peak_allocated=90, model_peak_allocated=90, exact=True),
            dict(trace="phases", conf="expandable_segments:True", real_peak_reserved=200, model_peak_reserved=150,
                 real_peak_allocated=80, model_peak_allocated=80, exact=False)]
    figures = smoke.allocator_figures(rows, jobs=5)
    assert figures["rows"] == 2 and figures["rows_exact"] == 1 and figures["worst_reserved_gap"] == 0.25
    assert figures["mismatches"] == "phases/expandable_segments:True" and figures["children_at_once"] == 5
    assert figures["detail"][1]["model_peak_reserved"] == 150


def test_runnable_names_what_gpu_smoke_cannot_run():
    assert smoke.runnable(dict(config="llama-2-7b", batch=1, seq=512, dtype="bf16", optimizer="adamw")) == ""
    assert smoke.runnable(dict(config="gpt2-124m", recompute=True, dtype="amp-bf16")) == ""
    assert smoke.runnable(dict(bytes=2**30)) == "a step given by its bytes (no model to run)"
    assert smoke.runnable(dict(config="x", kv_tokens=10)) == "keywords gpu-smoke does not run: kv_tokens"
    assert smoke.runnable(dict(config="x", training=False)) == "an inference step (gpu-smoke runs training steps)"
    assert smoke.runnable(dict(config="x", recompute=4)) == "recompute=4 (only True or False)"
    assert smoke.runnable(dict(config="x", dtype="mixed", optimizer="sgd")) == "dtype 'mixed'"
    # what a plain loop does not run, labkit.plan.verify's step does: today's FULL_STEPS levers
    assert smoke.how(dict(config="x", dtype="mixed")) == ("verify", "")
    assert smoke.how(dict(config="x", optimizer="adamw-8bit")) == ("verify", "")
    assert smoke.how(dict(config="x", dtype="bf16", fused_step=True, chunked_ce=True, beside={"ids": 8})) == ("verify", "")
    assert smoke.how(dict(config="x", batch=2, accumulate=True)) == ("verify", "")
    assert smoke.how(dict(config="x", beside={"a second model": "1 GiB"})) == ("plain", "")


def _notebook(folder, source):
    import nbformat
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell]
    (folder / "notebooks").mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / "notebooks" / "00_start_here.ipynb")
    return folder / "notebooks" / "00_start_here.ipynb"


def test_full_steps_reads_the_parameters_cell_and_restores_the_thread_count(tmp_path):
    path = _notebook(tmp_path, "import torch\ntorch.set_num_threads(1)\nFULL_STEPS = {'a': dict(bytes=1)}\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert smoke.full_steps(path) == {"a": {"bytes": 1}}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    _notebook(tmp_path, "%matplotlib inline\nFULL_STEPS = {}\n")
    with pytest.raises(smoke.NoPlan, match="uses IPython magics"):
        smoke.full_steps(path)


def test_a_notebook_check_without_a_runnable_step_is_skipped_saying_why(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_SIZE", "tiny")        # the check sets "full" for the parameters cell: undone after
    _notebook(tmp_path, "FULL_STEPS = {'naive attention': dict(bytes=2**30)}\n")
    check = smoke.check_notebook("00_start_here")
    with pytest.raises(smoke.Skip, match=r"no FULL_STEPS entry gpu-smoke can run \(naive attention: a step given by its bytes"):
        check(smoke.Context(time.monotonic() + 60, tmp_path))
    _notebook(tmp_path, "BATCH = 1\n")
    with pytest.raises(smoke.Skip, match="00_start_here: its parameters cell does not define FULL_STEPS "):
        check(smoke.Context(time.monotonic() + 60, tmp_path))
    with pytest.raises(smoke.Skip, match="is not here"):
        smoke.check_notebook("01_memory_anatomy")(smoke.Context(time.monotonic() + 60, tmp_path))


# ---- validate_allocator: the parts that run without CUDA ---------------------------------------------------
def test_play_replays_three_element_traces_with_real_tensors():
    """Issue 25 item 10: the child unpacked (key, n) from labkit.alloc's (key, n, category) events."""
    from labkit import alloc
    trace = alloc.growing_batch(layers=3, batches=(1, 2), per_sample=4096)
    assert len(trace[0]) == 3
    held, oom = va.play(trace, "cpu")
    assert held == {} and oom is None                                   # every activation freed again
    held, oom = va.play(alloc.pinned_holes(rounds=4, temp_start=8192, temp_step=1024, small=4096), "cpu")
    assert sorted(held) == [("s", i) for i in range(4)] and oom is None   # the small ones stay
    assert all(t.numel() == 4096 and t.dtype == torch.uint8 for t in held.values())
    held, oom = va.play([("a", 100), ("a", 300), ("b", 5), ("a", -300)], "cpu")
    assert list(held) == ["b"] and held["b"].numel() == 5                  # a live key allocated again is replaced


# A child that is the model itself: every row must then agree exactly. The child for BREAKS raises. BREAKS
# is a valid setting: a CUDA build of torch parses PYTORCH_CUDA_ALLOC_CONF as it is imported, and aborts
# (exit -6, before any Python runs) on one it cannot parse, even on a machine without a GPU.
BREAKS = "roundup_power2_divisions:4"
MODEL_CHILD = textwrap.dedent('''
    import json, sys
    from labkit.alloc import replay
    from labkit.scripts.validate_allocator import traces
    conf, trace_file, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if conf == "%s":
        raise RuntimeError("this child broke on purpose")
    out = {}
    for name, (trace, limit) in traces(1, trace_file).items():
        m = replay(trace, conf, **(dict(device=total, fraction=limit / total) if limit else {}))
        out[name] = dict(peak_reserved=m.peak_reserved, peak_allocated=m.peak_allocated, retries=m.retries,
                         segments_end=sorted(s["total_size"] for s in m.snapshot()["segments"]), oom_at=m.oom_at)
    events = [[1, 3 << 20], [2, 5 << 20], [1, -(3 << 20)], [3, 1 << 20]]
    m = replay(events, conf)
    out["recorded_step"] = dict(peak_reserved=m.peak_reserved, peak_allocated=m.peak_allocated, events=events,
                                dropped=False)
    print("RESULT " + json.dumps(out))
''' % BREAKS)
TOTAL = 8 << 30


def _model_children(tmp_path):
    trace = tmp_path / "llama.json"
    trace.write_text(json.dumps([["w", 4 << 20], ["x", 1 << 20], ["x", -(1 << 20)]]))
    return trace, lambda conf, layers, trace_file: [sys.executable, "-c", MODEL_CHILD, conf, str(trace_file), str(TOTAL)]


def test_validate_compares_each_childs_result_with_the_model(tmp_path):
    trace, command = _model_children(tmp_path)
    rows = va.validate(layers=1, trace_file=trace, jobs=2, settings=["", "expandable_segments:True"],
                       command=command, total=TOTAL)
    assert len(rows) == 2 * 5                        # 4 traces and the recorded step, per setting
    assert all(r["exact"] for r in rows), [r for r in rows if not r["exact"]]
    assert {r["conf"] for r in rows} == {"default", "expandable_segments:True"}


def test_a_child_that_raises_fails_the_run_with_its_traceback(tmp_path):
    trace, command = _model_children(tmp_path)
    with pytest.raises(va.ChildFailed) as e:
        va.validate(layers=1, trace_file=trace, jobs=2, settings=["", BREAKS], command=command, total=TOTAL)
    assert e.value.conf == BREAKS and e.value.returncode == 1
    assert "Traceback" in str(e.value) and "RuntimeError: this child broke on purpose" in str(e.value)


def test_a_child_without_a_result_or_past_its_timeout_fails_loudly():
    with pytest.raises(va.ChildFailed, match=r"failed \(exit 0\) without a result; its output ends:\nhello"):
        va.run_child([sys.executable, "-c", "print('hello')"], "")
    with pytest.raises(va.ChildFailed, match=r"failed \(exit killed after 1 s\)"):
        va.run_child([sys.executable, "-c", "import time; time.sleep(30)"], "", timeout=1)
    show = "import json, os; print('RESULT ' + json.dumps([os.environ[k] for k in ('PYTORCH_ALLOC_CONF', 'PYTORCH_CUDA_ALLOC_CONF')]))"
    assert va.run_child([sys.executable, "-c", show], "max_split_size_mb:64") == ["max_split_size_mb:64"] * 2


def test_main_reports_a_failed_child_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def broken(*args, **kwargs):
        raise va.ChildFailed("roundup_power2_divisions:4", 1, "Traceback (most recent call last):\nValueError: x")
    monkeypatch.setattr(va, "validate", broken)
    assert va.main([]) == 1
    err = capsys.readouterr().err
    assert "validate_allocator FAILED" in err and "roundup_power2_divisions:4" in err and "ValueError: x" in err


def test_records_dir_holds_a_readme_and_nothing_typed_by_hand():
    readme = records.GPU_DIR / "README.md"
    assert readme.exists() and "make gpu-smoke" in readme.read_text()
    for path in records.GPU_DIR.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            assert {"gpu", "date", "check", "torch", "status", "seconds"} <= set(rec), path
            assert path.name == smoke.gpu_file_name(rec["gpu"]), path
            assert not any(isinstance(v, float) and math.isnan(v) for v in rec.values())


@pytest.mark.parametrize("preset, kw, how", [
    ("llama-2-7b", dict(dtype="fp32", optimizer="adamw"), "plain"),
    ("gpt2-124m", dict(dtype="fp32", optimizer="sgd", recompute=True), "plain"),
    ("bert-large", dict(dtype="fp32", optimizer=None), "plain"),
    ("llama-2-7b", dict(dtype="mixed", optimizer="adamw", fused_step=True, chunked_ce=True,
                        beside={"the token ids": 512}), "verify"),
], ids=["llama-adamw", "gpt2-sgd-recompute", "bert-masked-lm", "llama-levers-beside"])
def test_a_full_steps_entry_runs_as_the_notebook_check_runs_it(preset, kw, how):
    """The notebook check's step on a CPU at tiny size (on a GPU it also reads the allocator): it runs, a
    plain step as lk.estimate's own plain_step and one with levers as labkit.plan.verify's step, and lk.track's
    peak is within a factor 2 of the estimate (a bound loose enough for any model family at tiny size, where
    the fixed buffers weigh most; the GPU record holds the real gap). What stays beside counts on both sides."""
    import labkit as lk
    config = lk.models.config(preset, "tiny")
    figures = smoke.run_step(dict(config=config, batch=2, seq=32, **kw), device="cpu")
    assert figures["how"] == how and figures["beside_bytes"] == sum(kw.get("beside", {}).values())
    assert figures["allocated_bytes"] is None and figures["reserved_bytes"] is None
    assert figures["tracked_bytes"] > figures["beside_bytes"] and (how == "verify" or figures["step_s"] > 0)
    assert 0.5 < figures["tracked_bytes"] / figures["estimated_bytes"] < 2, figures


# The checks whose code runs on a CPU too (Triton through its interpreter), at small sizes: every figure
# comes out and no problem is found. Times are not asserted (a CPU's wall clock, not the GPU's).
def test_the_flash_check_runs_and_finds_triton_as_close_to_the_reference_as_sdpa():
    figures = smoke.check_flash(smoke.Context(time.monotonic() + 600, ROOT, device="cpu"), shape=(1, 2, 64, 16))
    assert figures["problems"] == [], figures["problems"]
    for tag in ("full", "causal"):
        for part in ("out", "dq", "dk", "dv"):
            assert 0 <= figures[f"{tag}_{part}_err"] < 2e-2             # bf16 results: 2^-8 relative, a few roundings
        assert figures[f"{tag}_triton_fwd_tflops"] > 0 and figures[f"{tag}_sdpa_bwd_tflops"] > 0
    assert figures["block"] == 64 and figures["n"] == 64


def test_the_tf32_check_measures_both_precisions():
    figures = smoke.check_tf32(smoke.Context(time.monotonic() + 600, ROOT, device="cpu"), n=64)
    assert figures["problems"] == [] and figures["ieee_err"] < 1e-5        # a CPU has no TF32: both are fp32
    assert {"ieee_tflops", "tf32_tflops", "bf16_tflops", "tf32_speedup_ratio", "tf32_err"} <= set(figures)


TF32_SWITCH = """
import time, torch
from labkit.scripts import gpu_smoke as smoke
smoke.check_tf32(smoke.Context(time.monotonic() + 600, ".", device="cpu"), n=32)
restore = smoke._fp32_precision("tf32")
assert torch.backends.cuda.matmul.allow_tf32 is True and torch.get_float32_matmul_precision() == "high"
x, w, b = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3)
torch.nn.functional.linear(x, w, b), torch.bmm(x[None], w.T[None])    # cuBLASLt's paths on a GPU
restore()
assert torch.backends.cuda.matmul.allow_tf32 is False and torch.get_float32_matmul_precision() == "highest"
print("one API")
"""


def test_the_tf32_switch_keeps_the_legacy_setting_readable():
    """The tf32 check switches TF32 with set_float32_matmul_precision alone: after it, the legacy setting
    that cuBLASLt's paths read (torch.backends.cuda.matmul.allow_tf32) reads back without "mix of the
    legacy and new APIs", which torch.backends.cuda.matmul.fp32_precision caused. The flags and their
    checks are the same code on a CPU; a fresh process, since the flags are process-wide."""
    run = subprocess.run([sys.executable, "-c", TF32_SWITCH], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0 and run.stdout.strip().endswith("one API"), run.stderr[-2000:]


PARAMETERS_WITHOUT_IPYTHON = """
import importlib.util, json, os, pathlib
assert importlib.util.find_spec("IPython") is None, "IPython is not hidden"
os.environ["LABKIT_SIZE"] = "full"
from labkit.scripts import gpu_smoke as smoke
plans = {nb.stem: sorted(smoke.full_steps(nb)) for nb in sorted(pathlib.Path("notebooks").glob("[0-9][0-9]_*.ipynb"))}
assert importlib.util.find_spec("IPython") is None, "the stand-in outlived the parameters cell"
print(json.dumps(plans))
"""


def test_every_notebooks_full_steps_are_read_without_ipython():
    """The GPU image has no IPython, and notebook 12's parameters cell imports IPython.display: the notebook
    checks read every parameters cell at full size with IPython hidden (tests/no_triton/sitecustomize.py)."""
    env = {**os.environ, "LABKIT_HIDDEN_MODULES": "IPython", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "no_triton"), str(ROOT)])}
    run = subprocess.run([sys.executable, "-c", PARAMETERS_WITHOUT_IPYTHON], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    plans = json.loads(run.stdout.splitlines()[-1])
    assert list(plans) == list(records.NOTEBOOKS) and all(plans.values()), plans


def test_the_matmul_check_runs_notebook_12s_tiles():
    figures = smoke.check_matmul(smoke.Context(time.monotonic() + 600, ROOT, device="cpu"), n=64)
    assert figures["problems"] == [] and figures["triton_fp32_ieee_err"] < 1e-5
    assert figures["triton_bf16_err"] < 2e-2 and json.loads(figures["tiles"])["block_m"] == 128
