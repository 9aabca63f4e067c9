"""`make test-gpu` (labkit/scripts/gpu_run.py), tested on a CPU up to where it needs CUDA.

What runs here: the choice of jobs (all, by number, `todo` from the records), the number of workers from
memory and cores, the layout, the junit reading, the loop with its deadline (toy jobs that pass, fail and
overrun, their records written), the summary's finishing command, and the IPython profile that runs a
file in each kernel before its first cell (a stand-in for the fence, which needs CUDA).
"""
import json
import os
import pathlib
import subprocess
import sys
import time

import nbformat
import pytest

from labkit import records
from labkit.scripts import gpu_run as gr

ROOT = pathlib.Path(__file__).resolve().parent.parent
GiB = 2**30
ENV = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0"}


def _rec(check, status, date, gpu=ENV["gpu"], **extra):
    return {"gpu": gpu, "date": date, "check": check, "torch": "2.11.0", "status": status, "seconds": 90.0, **extra}


def test_every_notebook_and_the_gpu_tests_are_jobs_longest_first():
    jobs = gr.select(None)
    names = [j.name for j in jobs]
    assert sorted(names) == sorted([*records.NOTEBOOKS, gr.TEST_GPU])
    assert [j.minutes for j in jobs] == sorted((j.minutes for j in jobs), reverse=True)
    assert all(f"test-gpu:{n}" in records.GPU_RUNS for n in names)        # each has a record name


def test_jobs_by_number_name_or_todo():
    assert [j.name for j in gr.select(["5", "test_gpu"])] == ["05_caching_allocator", "test_gpu"]
    with pytest.raises(ValueError, match=r"'99' names no notebook; there are 00, 01"):
        gr.select(["99"])
    path = ROOT / "notebooks" / "03_activation_checkpointing.ipynb"
    recs = [_rec("test-gpu:03_activation_checkpointing", "ok", "2026-11-01T00:00:00Z", notebook_sha=gr.digest(path)),
            _rec("test-gpu:05_caching_allocator", "ok", "2026-11-01T00:00:00Z", notebook_sha="an-old-version"),
            _rec("test-gpu:00_start_here", "ok", "2026-11-01T00:00:00Z", notebook_sha=gr.digest(
                ROOT / "notebooks" / "00_start_here.ipynb")),
            _rec("test-gpu:00_start_here", "failed", "2026-11-02T00:00:00Z")]          # the latest run failed
    todo = {j.name for j in gr.select(["todo"], recs, ENV["gpu"])}
    assert "03_activation_checkpointing" not in todo                   # passed in its present form
    assert {"05_caching_allocator", "00_start_here", gr.TEST_GPU} <= todo
    assert len({j.name for j in gr.select(["todo"], recs, "another GPU")}) == len(records.NOTEBOOKS) + 1


def test_a_jobs_minutes_come_from_its_last_run_on_this_gpu_else_its_metadata():
    path = ROOT / "notebooks" / "03_activation_checkpointing.ipynb"
    meta = json.loads(path.read_text())["metadata"]["labkit"]["minutes_full"]
    assert gr.estimated_minutes(path) == meta + gr.STARTUP_MIN
    recs = [_rec("test-gpu:03_activation_checkpointing", "ok", "2026-11-01T00:00:00Z")]
    assert gr.estimated_minutes(path, recs, ENV["gpu"]) == 1.5                # its 90 s
    assert gr.estimated_minutes(path, recs, "another GPU") == meta + gr.STARTUP_MIN


def test_workers_are_what_memory_and_cores_allow():
    """An H100 (79 GiB free) holds 3 fences of 21.6 GiB with 2 GiB beside each and 4 GiB kept free; an H200
    (139 GiB) 5, where 16 cores allow 5 (3 each); never more than the jobs, never fewer than one."""
    assert gr.workers_for(79 * GiB, 16, 15) == 3
    assert gr.workers_for(139 * GiB, 16, 15) == 5
    assert gr.workers_for(139 * GiB, 8, 15) == 2
    assert gr.workers_for(139 * GiB, 64, 2) == 2
    assert gr.workers_for(20 * GiB, 2, 15) == 1


def test_the_layout_puts_the_longest_first_on_the_least_loaded_worker():
    jobs = [gr.Job(n, None, m) for n, m in [("a", 3), ("b", 2), ("c", 2), ("d", 1), ("e", 1)]]
    plan, load = gr.layout(jobs, 2)
    assert plan == [["a", "d", "e"], ["b", "c"]] and load == [5, 4]           # a tie goes to the first worker


JUNIT = """<testsuites><testsuite>
<testcase name="Cell 0"/><testcase name="Cell 1"><failure message="AssertionError: the peak">tb</failure></testcase>
<testcase name="Cell 2"/></testsuite></testsuites>"""


def test_outcome_reads_cells_and_the_first_line_of_each_failure(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(JUNIT)
    status, fields = gr.outcome(xml, 1)
    assert status == "failed" and fields == dict(cells=3, cells_failed=1, failed="Cell 1: AssertionError: the peak")
    xml.write_text(JUNIT.replace('<failure message="AssertionError: the peak">tb</failure>', ""))
    assert gr.outcome(xml, 0) == ("ok", dict(cells=3, cells_failed=0))
    status, fields = gr.outcome(tmp_path / "none.xml", 4)                   # pytest died before its report
    assert status == "failed" and "pytest exit 4" in fields["error"]


TOY = """
import json, os, sys, time
name, xml = sys.argv[1], sys.argv[2]
peak = os.environ["LABKIT_GPU_PEAK_FILE"]
json.dump({"peak_reserved_bytes": 5 * 2**30, "peak_allocated_bytes": 4 * 2**30, "fence_bytes": 22 * 2**30}, open(peak, "w"))
if name.startswith("13"):
    time.sleep(300)                      # overruns the deadline
if name.startswith("00"):
    time.sleep(12)                       # ends with under 30 s of the budget left: nothing starts after it
failed = '<failure message="AssertionError: no">x</failure>' if name.startswith("01") else ""
open(xml, "w").write(f'<testsuites><testsuite><testcase name="Cell 0">{failed}</testcase></testsuite></testsuites>')
sys.exit(1 if failed else 0)
"""


def test_the_run_records_each_job_cuts_what_overruns_and_names_what_never_started(tmp_path):
    """Toy jobs (a Python child per job) in place of nbval: one passes, one fails, one overruns the deadline
    and is cut (recorded as skipped, with the command that finishes it), one never starts; each record
    carries the kernel's peak, the fence and the notebook's hash."""
    jobs = [j for j in gr.select(["13", "00", "01", "02"]) if j.name != "02_mixed_precision"]
    jobs.append(gr.Job("02_mixed_precision", ROOT / "notebooks" / "02_mixed_precision.ipynb", 1))
    toy = tmp_path / "toy.py"
    toy.write_text(TOY)
    t0 = time.time()
    results, not_started = gr.run(jobs, ENV, tmp_path / "records", workers=2, budget=40, started=t0,
                                  build=tmp_path / "build", echo=lambda line: None,
                                  command=lambda job, left, xml: [sys.executable, str(toy), job.name, str(xml)])
    assert time.time() - t0 < 40 + 15                # the budget, and room for a busy machine
    got = {name: (status, fields) for name, status, _, fields in results}
    assert got["00_start_here"][0] == "ok" and got["00_start_here"][1]["peak_reserved_bytes"] == 5 * GiB
    assert got["01_memory_anatomy"][0] == "failed" and got["01_memory_anatomy"][1]["failed"] == "Cell 0: AssertionError: no"
    assert got["13_capstone_fit_what_does_not_fit"][0] == "skipped"
    assert "make test-gpu NOTEBOOKS=13" in got["13_capstone_fit_what_does_not_fit"][1]["reason"]
    assert not_started == ["02_mixed_precision"]                            # less than 30 s left to start it
    written = records.gpu_records(tmp_path / "records")
    assert {r["check"] for r in written} == {"test-gpu:00_start_here", "test-gpu:01_memory_anatomy",
                                             "test-gpu:13_capstone_fit_what_does_not_fit"}
    ok = next(r for r in written if r["status"] == "ok")
    assert ok["notebook_sha"] == gr.digest(ROOT / "notebooks" / "00_start_here.ipynb") and ok["workers"] == 2
    text, status = gr.summary(results, not_started, [j.name for j in gr.select(None)], written, ENV["gpu"])
    assert status == 1 and "not started (out of time): 02_mixed_precision" in text
    assert 'To finish: make test-gpu NOTEBOOKS="' in text and "00_start_here" not in text.split("To finish")[1]


def test_each_kernel_runs_the_fence_file_first_and_keeps_none_of_its_names(tmp_path):
    """The IPython profile gpu_run writes: a kernel started by nbval runs the named file before the first
    cell, in a namespace of its own. A stand-in file here (the real fence needs CUDA) writes a mark."""
    mark = tmp_path / "mark.json"
    stand_in = tmp_path / "fence.py"
    stand_in.write_text(f"import json\nSECRET = 1\njson.dump({{'ran': True}}, open({str(mark)!r}, 'w'))\n")
    profile = gr.ipython_dir(tmp_path / "build", stand_in)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import json, pathlib\n"
                                          f"assert json.loads(pathlib.Path({str(mark)!r}).read_text()) == {{'ran': True}}\n"
                                          "assert 'SECRET' not in globals()")]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                          "--nbval-current-env", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "IPYTHONDIR": str(profile)})
    assert run.returncode == 0, run.stdout[-3000:]
    assert mark.exists()


def test_the_plan_fits_ten_minutes_on_an_h100():
    """--plan on a CPU: an 80 GB GPU and 16 cores. The longest worker's estimate stays under 10 minutes."""
    run = subprocess.run([sys.executable, "-m", "labkit.scripts.gpu_run", "--plan"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    head = run.stdout.splitlines()[0]
    assert "3 workers" in head, head
    minutes = float(head.split("estimated ")[1].split(" min")[0])
    assert minutes < 10, head


def test_make_test_gpu_passes_the_commands_start_notebooks_and_the_wheels():
    dry = subprocess.run(["make", "-n", "test-gpu", "PYTHON=python3", "NOTEBOOKS=03 todo", "WHEELS=build/gpu-wheels",
                          "GPU_WORKERS=2"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "--no-index --no-deps --no-compile --upgrade --target" in dry and "build/gpu-wheels/*.whl" in dry
    assert f"PYTHONPATH={ROOT}/build/gpu-site:{ROOT}" in dry
    assert "-m labkit.scripts.gpu_run --started $started --notebooks 03 todo" in dry and "--workers 2" in dry


def test_the_fence_keeps_the_kernels_peak_across_resets_and_fences_again(tmp_path, monkeypatch):
    """labkit/scripts/gpu_fence.py with torch.cuda's memory functions stood in for (a CPU has none): the
    fraction is set to fence / card, a notebook's reset_peak_memory_stats() first folds the peak so far
    into the record, the file is rewritten after every cell, and a cell that lifts the fraction (a budget
    that restored 1.0) is counted and fenced again."""
    import types
    import torch
    import IPython
    state = {"fraction": 1.0, "reserved": 0, "allocated": 0, "resets": 0}
    callbacks = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: state.update(fraction=f))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda.memory, "reset_peak_memory_stats",
                        lambda device=None: state.update(reserved=0, allocated=0, resets=state["resets"] + 1))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", torch.cuda.memory.reset_peak_memory_stats)
    shell = types.SimpleNamespace(events=types.SimpleNamespace(register=lambda event, fn: callbacks.append((event, fn))))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    peak_file = tmp_path / "peak.json"
    monkeypatch.setenv("LABKIT_GPU_FENCE", str(22 * GiB))
    monkeypatch.setenv("LABKIT_GPU_PEAK_FILE", str(peak_file))
    exec((ROOT / "labkit" / "scripts" / "gpu_fence.py").read_text(), {"__name__": "labkit_gpu_fence"})
    assert state["fraction"] == 22 / 80 and [e for e, _ in callbacks] == ["post_run_cell"]
    after_cell = callbacks[0][1]
    assert json.loads(peak_file.read_text())["cells"] == 0
    state.update(reserved=12 * GiB, allocated=10 * GiB)         # cell 1 peaks at 12 GiB reserved
    after_cell(None)
    state.update(reserved=13 * GiB)
    torch.cuda.reset_peak_memory_stats()                        # lk.free() in cell 2: the 13 GiB is kept
    assert state["resets"] == 1 and state["reserved"] == 0
    state.update(reserved=3 * GiB, allocated=2 * GiB, fraction=1.0)   # cell 2 also lifts the fence
    after_cell(None)
    peak = json.loads(peak_file.read_text())
    assert peak["peak_reserved_bytes"] == 13 * GiB and peak["peak_allocated_bytes"] == 10 * GiB
    assert peak["cells"] == 2 and peak["fence_lifted"] == 1 and state["fraction"] == 22 / 80
    assert peak["fence_bytes"] == 22 * GiB and peak["gpu_memory_bytes"] == 80 * GiB
