"""A normal install (`pip install .`, a wheel), not only the editable one, holds a working labkit."""
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "labkit", "data/corpus.txt", "data/tokenizer.json", "data/build_corpus.py"]


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
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp_path / "dist", src],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("labkit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"labkit/scripts/tensor_parallel.py", "labkit/scripts/pipeline_parallel.py", "labkit/lock.txt",
            "labkit/_data/corpus.txt", "labkit/_data/tokenizer.json"} <= names, sorted(names)

    # Install without dependencies next to this environment's packages, and run it from elsewhere:
    # the installed copy comes first on sys.path, ahead of the editable one.
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", site, wheel],
                   check=True, capture_output=True)
    check = f"""
import importlib.util, pathlib, labkit as lk, labkit.parallel
site = pathlib.Path({str(site)!r})
assert pathlib.Path(lk.__file__).is_relative_to(site), lk.__file__
assert lk.data.DATA_DIR == site / "labkit" / "_data", lk.data.DATA_DIR
batch = next(lk.data.batches(2, 16))
assert tuple(batch.shape) == (2, 16) and int(batch.max()) < 4096
script = importlib.util.find_spec("labkit.scripts.tensor_parallel").origin
assert pathlib.Path(script).is_relative_to(site), script
result = lk.parallel.launch("labkit.scripts.tensor_parallel", nproc=2, timeout=240)
assert result["world"] == 2, result
print("ok", lk.data.DATA_DIR, result["world"])
"""
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_DATA"}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.splitlines()[-1].startswith("ok"), done.stdout + done.stderr[-3000:]
