"""The twin (labkit/scripts/twin.py, `make test-twin`): the GPU image's versions, the lock's everywhere else.

Building it needs the registry and 6 GB (`make test-twin`, run by .ci/run); here, offline: its constraints,
its requirements, and that a venv whose inputs have not changed is kept as it is.
"""
import pathlib
import re
import subprocess
import sys

import pytest

from labkit.scripts import twin

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _pins(text):
    return {re.sub(r"[-_.]+", "-", l.split("==")[0]).lower(): l.split("==")[1].split(" ")[0]
            for l in text.splitlines() if "==" in l and not l.startswith("#")}


def test_the_twin_takes_the_images_versions_and_the_locks_for_the_rest():
    pins = _pins(twin.constraints())
    image = {name: line.split("==")[1] for name, line in twin.image_pins().items()}
    lock = _pins((ROOT / "labkit" / "lock.txt").read_text())
    assert pins["torch"] == image["torch"] == "2.11.0" and pins["transformers"] == "5.17.0"
    assert pins["triton"] == "3.6.0"
    assert {n: v for n, v in pins.items() if n not in image} == {
        n: v for n, v in lock.items() if n not in image and not twin.TORCH_STACK.match(n)}
    # torch 2.11's own CUDA libraries and setuptools pin, not torch 2.13's from the lock
    assert not [n for n in pins if n.startswith(("nvidia-", "cuda-")) or n == "setuptools"]


def test_the_twins_requirements_are_labkits_without_torch_and_the_browser_driver():
    reqs = twin.requirements()
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in reqs}
    assert "torch" not in names and "labkit" not in names and "playwright" not in names
    assert {"transformers", "nbval", "ipykernel", "onnxruntime", "nbgrader", "pytest-xdist"} <= names


def test_a_malformed_image_list_is_refused_naming_the_line(tmp_path):
    bad = tmp_path / "image.txt"
    bad.write_text("torch==2.11.0\ntransformers = 5.17\n")
    assert twin.image_pins(bad) == {"torch": "torch==2.11.0"}            # a line without == is a name, not a pin
    bad.write_text("torch==2.11.0\ntransformers==5.17 pytest\n")
    assert twin.image_pins(bad)["transformers"] == "transformers==5.17"  # several items on a line: only pins count
    bad.write_text("transformers==5.17.0\n")
    with pytest.raises(ValueError, match="must pin torch"):
        twin.image_pins(bad)
    bad.write_text("torch==2.11.0\ntransformers==5.17.0!\n")
    with pytest.raises(ValueError, match=r"image.txt:2: expected name==version, got 'transformers==5.17.0!'"):
        twin.image_pins(bad)


def test_a_venv_whose_inputs_are_unchanged_is_kept(tmp_path):
    """The stamp names the hash of the Python, the constraints and the requirements: while it matches, the
    venv is not touched (no pip, no network); a changed input makes another stamp."""
    venv = tmp_path / "twin"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    text, reqs = twin.constraints(), twin.requirements()
    mark = venv / f".twin-{twin.stamp(sys.executable, text, reqs)}"
    mark.write_text("built\n")
    said = []
    assert twin.build(venv, sys.executable, log=said.append) == venv / "bin" / "python"
    assert said == [f"twin: {venv} is up to date ({mark.name})"]
    assert twin.stamp(sys.executable, text + "numpy==1.0\n", reqs) != mark.name[len(".twin-"):]


def test_find_python_skips_a_shim_that_does_not_run(tmp_path, monkeypatch):
    shim = tmp_path / "python3.12"
    shim.write_text("#!/bin/sh\nexit 127\n")                 # pyenv's shim where 3.12 is not selected
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(pathlib.Path, "home", lambda: tmp_path)     # no ~/.pyenv either
    with pytest.raises(SystemExit, match="the twin needs Python 3.12"):
        twin.find_python()


def test_make_test_twin_runs_everything_with_labkit_from_the_checkout():
    dry = subprocess.run(["make", "-n", "test-twin", "TWIN=/tmp/t"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout
    assert "labkit/scripts/twin.py env --venv /tmp/t" in dry
    assert f"PYTHONPATH={ROOT}/tests/twin:{ROOT} /tmp/t/bin/python -m pytest" in dry and "tests notebooks" in dry
    assert "--nbval-current-env" in dry
