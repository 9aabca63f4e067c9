"""engines at their edges: bad engine lists refused before any work, and no folder left behind or shared."""
import pathlib
import subprocess
import tempfile

import pytest

from labkit import engines


@pytest.fixture
def no_subprocess(monkeypatch):
    """Any engine process started fails the test: the refusals must come before the first run."""
    def refuse(*a, **k):
        raise AssertionError("an engine ran before the arguments were checked")
    monkeypatch.setattr(subprocess, "run", refuse)


@pytest.mark.parametrize("bad, err, says", [
    ("onnxruntime", TypeError, r"engines must be a list of engine names .* got 'onnxruntime'"),
    (["eager", "onnxrutime"], ValueError, r"engine must be one of .* got 'onnxrutime'"),
    ([("inductor", "fast")], TypeError, r"each engine must be a name or a \(name, \{options\}\) pair, got \('inductor', 'fast'\)"),
    ([("eager", {"speed": 2})], TypeError, "run\\(\\) has no option 'speed'"),
    ([("onnxruntime", {"fp16": True})], ValueError, "onnxruntime runs the fp32 export, got fp16=True"),
    ([3], TypeError, "each engine must be a name .* got 3"),
])
def test_bad_engines_are_refused_before_eager_runs(no_subprocess, bad, err, says):
    with pytest.raises(err, match=says):
        engines.compare(bad)


def test_bad_run_arguments_are_refused_before_any_work(no_subprocess):
    with pytest.raises(ValueError, match="model must be one of .* got 'resnet-9'"):
        engines.compare(["eager"], model="resnet-9")
    with pytest.raises(ValueError, match="engine must be one of .* got 'tensorrtt'"):
        engines.run("tensorrtt")


def test_each_workdir_is_a_folder_of_its_own():
    a, b = engines.workdir(), engines.workdir()
    assert a != b and a.is_dir() and b.is_dir() and a.parent == pathlib.Path(tempfile.gettempdir())


def test_run_without_a_workdir_leaves_no_folder_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # a temp dir no other process writes to
    r = engines.run("eager", repeat=1)
    assert list(tmp_path.iterdir()) == []
    assert r.ran and r.values.shape == (1, 1000) and r.output is None and r.artifact is None


def test_malloc_mmap_threshold_is_checked_before_any_work(no_subprocess):
    with pytest.raises(ValueError, match="malloc_mmap_threshold must be .*, got '64k'"):
        engines.run("eager", malloc_mmap_threshold="64k")
    with pytest.raises(ValueError, match="malloc_mmap_threshold must be .* got -1"):
        engines.compare([("eager", {"malloc_mmap_threshold": -1})])


@pytest.mark.parametrize("threshold", [None, 65536])
def test_every_engine_runs_the_same_malloc_unless_told(monkeypatch, tmp_path, threshold):
    """An MALLOC_MMAP_THRESHOLD_ the caller's shell set does not reach the engine's process (it would time one
    engine under another malloc than the next); malloc_mmap_threshold sets it for that one run."""
    seen = {}

    def capture(args, env, **kwargs):
        seen.update(env)
        raise KeyboardInterrupt                     # stop before anything runs
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1234")
    monkeypatch.setattr(subprocess, "run", capture)
    with pytest.raises(KeyboardInterrupt):
        engines.run("eager", workdir=tmp_path, malloc_mmap_threshold=threshold)
    assert seen.get("MALLOC_MMAP_THRESHOLD_") == (None if threshold is None else str(threshold))
    assert seen["OMP_NUM_THREADS"] == "1"
