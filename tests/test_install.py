"""A normal install (`pip install .`, a wheel), not only the editable one, holds a working labkit."""
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "labkit", "data"]


def test_wheel_installs_and_runs(tmp_path):
    # Build from a copy of the tracked sources, so the repository gets no build/ or egg-info from us.
    src = tmp_path / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist",
                            src], check=True, capture_output=True, text=True)
    # setuptools warns (about 100 lines, in `make env` too) for each folder of data/ not named as a package.
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr, built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("labkit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    seeds = {f"labkit/_data/seeds/{p.name}" for p in (ROOT / "data" / "seeds").iterdir()}
    configs = {f"labkit/_data/configs/{p.parent.name}/{p.name}" for p in (ROOT / "data" / "configs").glob("*/*.json")}
    assert {"labkit/scripts/tensor_parallel.py", "labkit/scripts/pipeline_parallel.py", "labkit/lock.txt",
            "labkit/_data/corpus.txt", "labkit/_data/tokenizer.json", "labkit/_data/gpu/README.md",
            "labkit/_data/gpu/image.txt", "labkit/_data/workbook.json", *seeds, *configs} <= names, sorted(names)
    assert seeds and configs
    packages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "labkit").rglob("__init__.py")}
    assert packages <= names, f"pyproject.toml's packages lack {sorted(packages - names)}"

    # Install without dependencies next to this environment's packages, and run it from elsewhere:
    # the installed copy comes first on sys.path, ahead of the editable one.
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel],
                   check=True, capture_output=True)
    check = f"""
import importlib.util, pathlib, labkit as lk, labkit.launch, labkit.tensor_parallel, labkit.alloc, labkit.paged, labkit.workbook
site = pathlib.Path({str(site)!r})
assert pathlib.Path(lk.__file__).is_relative_to(site), lk.__file__
assert lk.data.DATA_DIR == site / "labkit" / "_data", lk.data.DATA_DIR
batch = next(lk.data.batches(2, 16))
assert tuple(batch.shape) == (2, 16) and int(batch.max()) < 4096
script = importlib.util.find_spec("labkit.scripts.tensor_parallel").origin
assert pathlib.Path(script).is_relative_to(site), script
result = lk.launch.launch("labkit.scripts.tensor_parallel", nproc=2, timeout=240)
assert result["world"] == 2, result
print("ok", lk.data.DATA_DIR, result["world"])
"""
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_DATA"}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("ok"), done.stdout + done.stderr[-3000:]


def make_dry(*args):
    """What `make -n ARGS` would run (nothing is run), from the repository root."""
    done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_lab_opens_the_student_build_and_the_answer_key_is_one_command_away():
    student = make_dry("lab")                         # the build is brought in step unless KEY is set
    assert '[ -n "" ]' in student and "else .venv/bin/python -m labkit.cli student --in-step" in student
    assert "--ServerApp.root_dir=build/student" in student
    key = make_dry("lab", "KEY=1")
    assert '[ -n "1" ]' in key and "--ServerApp.root_dir=notebooks" in key


def test_cpu_only_torch_is_one_variable_away():
    """make env TORCH_INDEX=...: torch alone from that index and no other (no fallback to the registry's CUDA
    build), before anything else; its dependencies and the rest from the registry."""
    cpu = make_dry("-W", "pyproject.toml", "env", "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
    lines = [l for l in cpu.splitlines() if " -m pip install " in l]
    assert "--no-deps --index-url https://download.pytorch.org/whl/cpu -c labkit/lock.txt torch==2.13.0" in lines[0]
    assert "extra-index-url" not in cpu and all("index-url" not in l for l in lines[1:])
    default = make_dry("-W", "pyproject.toml", "env")
    assert "index-url" not in default


def test_an_unreachable_torch_index_stops_make_env_and_says_so(tmp_path):
    """Where TORCH_INDEX cannot be reached, make stops with a clear message and installs no torch at all:
    it used to retry, then take the registry's 6 GB CUDA build quietly. Run as a learner's pip would be:
    no machine-wide configuration, no local wheels."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    python = pathlib.Path(sys.base_prefix) / "bin" / "python3"
    done = subprocess.run(["make", "env", f"VENV={tmp_path / 'venv'}", f"PY={python}",
                           "TORCH_INDEX=http://127.0.0.1:9/simple"],            # port 9: nothing listens
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "torch could not be installed from TORCH_INDEX=http://127.0.0.1:9/simple" in done.stdout, done.stdout
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/torch")), "a torch was installed anyway"


def test_gpu_targets_run_an_uninstalled_labkit_with_any_python():
    """make test-gpu PYTHON=python3 on a machine whose Python has a CUDA torch: nothing installed, labkit
    from this folder on PYTHONPATH (nbval's kernels, started in notebooks/, inherit it), their own Python."""
    for target in ("test-gpu", "gpu-smoke"):
        dry = make_dry(target, "PYTHON=python3")
        assert f"PYTHONPATH={ROOT}" in dry and "pip install" not in dry, dry
    assert "-m labkit.scripts.gpu_run" in make_dry("test-gpu", "PYTHON=python3")
    from labkit.scripts import gpu_run                                # each notebook's kernel: this Python
    job = gpu_run.Job("00_start_here", ROOT / "notebooks" / "00_start_here.ipynb", 1.0)
    assert "--nbval-current-env" in gpu_run.command(job, 300, "x.xml")
    assert "-m labkit.scripts.gpu_smoke" in make_dry("gpu-smoke")


def test_gpu_targets_say_what_is_missing_not_that_a_gpu_is(tmp_path):
    done = subprocess.run(["make", "test-gpu", f"PYTHON={tmp_path / 'no-venv' / 'python'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "does not exist: run 'make env' first" in done.stdout, done.stdout + done.stderr
    assert "needs a CUDA GPU" not in done.stdout
    # A Python without torch (the interpreter this venv was made from, when it has none).
    base = pathlib.Path(sys.base_prefix) / "bin" / "python3"
    probe = subprocess.run([base, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
                           capture_output=True, text=True)
    if base.exists() and probe.stdout.strip() == "True":
        done = subprocess.run([base, ROOT / "labkit" / "scripts" / "check_python.py", "test-gpu"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "has no torch: run 'make env' first" in done.stdout, done.stdout + done.stderr


def test_check_python_on_this_machine():
    """Here (a venv that make built): everything is installed, so only a missing CUDA GPU stops test-gpu."""
    import torch
    done = subprocess.run([sys.executable, ROOT / "labkit" / "scripts" / "check_python.py", "test-gpu"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if torch.cuda.is_available():
        assert done.returncode == 0, done.stdout
    else:
        # The registry's Linux torch is a CUDA build: on a laptop without a GPU it says so, not "CPU-only".
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        assert done.returncode == 2 and "needs a CUDA GPU" in done.stdout and f"({build})" in done.stdout, done.stdout
    gpu_smoke = subprocess.run([sys.executable, ROOT / "labkit" / "scripts" / "check_python.py", "gpu-smoke"],
                               capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert gpu_smoke.returncode == 0, gpu_smoke.stdout               # gpu_smoke itself says "no CUDA" and exits 2


def test_make_student_keeps_a_notebook_the_learner_worked_in(tmp_path, capsys):
    """`make student` (labkit student) brings the build in step as `make lab` does: a notebook the learner
    changed under build/student/ stays as it is (it used to be overwritten: work lost)."""
    from labkit.cli import main
    dest = tmp_path / "student"
    assert main(["student", "--dest", str(dest)]) == 0
    first = sorted(dest.glob("[0-9][0-9]_*.ipynb"))
    assert first and f"student version: {first[0]}" in capsys.readouterr().out
    mine = first[0].read_text().replace('"cells": [', '"cells": [{"cell_type": "markdown", "id": "mine", '
                                        '"metadata": {}, "source": "my notes"}, ', 1)
    first[0].write_text(mine)
    assert main(["student", "--dest", str(dest)]) == 0
    assert first[0].read_text() == mine and "is in step with notebooks/" in capsys.readouterr().out


def test_make_instructor_names_nbgrader_where_this_python_has_it(tmp_path, capsys):
    """The hint works without the venv on the PATH: it names the venv's own nbgrader."""
    from labkit.course import instructor
    instructor(dest=tmp_path / "course")
    hint = capsys.readouterr().out.splitlines()[-1]
    nbgrader = pathlib.Path(sys.executable).parent / "nbgrader"
    assert f"cd {tmp_path / 'course'} && {nbgrader} generate_assignment 00_start_here" in hint, hint
    assert nbgrader.exists()
