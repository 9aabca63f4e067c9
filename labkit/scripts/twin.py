"""The twin: a second environment with the GPU image's versions, on a CPU (`make test-twin`, run by .ci/run).

    python3 labkit/scripts/twin.py constraints            # the twin's constraints, printed
    python3 labkit/scripts/twin.py env [--venv DIR]       # builds DIR (default build/twin), or keeps it as it is

The GPU machine's image has Python 3.12, torch 2.11 (a CUDA 13 build), triton 3.6 and transformers 5.17,
where `make env` installs Python 3.11 and torch 2.13: most first-run failures on a GPU are version
differences, not CUDA. And a learner's Linux laptop gets the registry's torch, a CUDA build running on a
CPU. The twin has both: Python 3.12 and every version data/gpu/image.txt names (read off the image),
torch included, from the registry alone as a user's environment would be (no local wheels, no
machine-wide pip configuration: PIP_CONFIG_FILE=/dev/null); every other package at the lock's version.
labkit is not installed in it (pyproject.toml pins torch 2.13): it comes from the checkout through
PYTHONPATH, as on the GPU machine. `make test-twin` also puts tests/twin/ first on PYTHONPATH: its
sitecustomize gives triton 3.6's CPU interpreter triton 3.7's fix for numpy 2.4+ (the GPU never runs it).

The venv is kept while its inputs (the lock, image.txt, pyproject.toml's requirements, the Python) are
unchanged: a stamp file in it names their hash. A build downloads about 3 GB (4 minutes on a fast line,
17 on a loaded machine); pip's HTTP cache does not shorten a rebuild where the registry's answers carry no
cache headers (pip then caches nothing), so .ci/run keeps the venv itself between runs instead.
Runs with the standard library alone (any Python 3.11+, before anything is installed).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCK = ROOT / "labkit" / "lock.txt"
IMAGE = ROOT / "data" / "gpu" / "image.txt"
VENV = ROOT / "build" / "twin"
# Packages whose versions follow torch's own requirements, not the lock's (the lock holds torch 2.13's).
TORCH_STACK = re.compile(r"^(nvidia-|cuda-|setuptools$)")
# labkit's extras the twin leaves out: the browser test's driver (the twin runs no browser).
SKIP_EXTRAS = ("browser",)


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(line):
    return _norm(re.match(r"[A-Za-z0-9_.-]+", line).group(0))


def image_pins(path=IMAGE):
    """{name: "name==version"} of data/gpu/image.txt's pins (comments and bare names skipped; a line may hold
    several items, as labkit/scripts/gpu_wheels.py reads it)."""
    pins = {}
    for number, raw in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        for item in raw.split("#")[0].split():
            if "==" not in item:
                continue
            if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", item):
                raise ValueError(f"{path}:{number}: expected name==version, got {item!r}")
            pins[_name(item)] = item
    if "torch" not in pins:
        raise ValueError(f"{path} must pin torch (name==version): the twin is built around the image's torch")
    return pins


def constraints(lock=LOCK, image=IMAGE):
    """The twin's pip constraints: the lock's lines, less torch's own stack (its CUDA libraries, triton,
    setuptools) and every package the image pins, then the image's pins."""
    pins = image_pins(image)
    kept = [line for line in pathlib.Path(lock).read_text().splitlines()
            if line.strip() and not line.startswith("#")
            and _name(line) not in pins and not TORCH_STACK.match(_name(line))]
    return "\n".join(["# The twin's constraints (labkit/scripts/twin.py): labkit/lock.txt with the GPU image's versions",
                      *kept, *pins.values()]) + "\n"


def requirements(pyproject=ROOT / "pyproject.toml"):
    """labkit's requirements with every extra but SKIP_EXTRAS, torch left out (installed first, alone)."""
    project = tomllib.loads(pathlib.Path(pyproject).read_text())["project"]
    reqs = list(project["dependencies"])
    for extra, items in project["optional-dependencies"].items():
        if extra not in SKIP_EXTRAS and extra != "all":
            reqs += items
    out = []
    for req in reqs:
        if _name(req) not in ("torch", "labkit") and req not in out:
            out.append(req)
    return out


def _clean_env():
    spec = importlib.util.spec_from_file_location("_check_resolution", ROOT / "labkit" / "scripts" / "check_resolution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)          # standard library only: no labkit, no torch
    return module.clean_env()


def find_python(version="3.12"):
    """A Python of that version that runs: python3.12 on the PATH (a pyenv shim may not), else pyenv's newest
    (~/.pyenv/versions/3.12.*)."""
    pyenv = sorted(pathlib.Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)])
    for candidate in [shutil.which(f"python{version}"), *map(str, reversed(pyenv))]:
        if candidate and subprocess.run([candidate, "-c", f"import sys, venv; assert sys.version.startswith('{version}.')"],
                                        capture_output=True).returncode == 0:
            return candidate
    raise SystemExit(f"the twin needs Python {version}: none on the PATH (python{version}) nor in ~/.pyenv. "
                     f"Install one (pyenv install {version}, or the system's python{version}-venv), or name it: "
                     f"make test-twin TWIN_PY=/path/to/python{version}")


def stamp(python, text, reqs):
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                             check=True).stdout
    return hashlib.sha256("\n".join([version, text, *reqs]).encode()).hexdigest()[:16]


def build(venv=VENV, python=None, log=print):
    """The twin venv at `venv`, built unless its stamp matches; returns its Python."""
    venv = pathlib.Path(venv)
    python = python or find_python()
    text, reqs = constraints(), requirements()
    mark = venv / f".twin-{stamp(python, text, reqs)}"
    exe = venv / "bin" / "python"
    if mark.exists() and exe.exists():
        log(f"twin: {venv} is up to date ({mark.name})")
        return exe
    t0 = time.time()
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    (venv / "constraints.txt").write_text(text)
    torch = image_pins()["torch"]
    env = _clean_env()
    pip = [str(exe), "-m", "pip", "install", "-q", "-c", str(venv / "constraints.txt")]
    log(f"twin: {venv}: Python {python}, {torch} from the registry (a CUDA build: about 3 GB to download, "
        f"minutes without output), then {len(reqs)} requirements")
    subprocess.run([*pip, "--upgrade", "pip"], check=True, env=env)          # the lock's pip, as make env does
    subprocess.run([*pip, torch], check=True, env=env)
    subprocess.run([*pip, *reqs], check=True, env=env)
    mark.write_text(f"built in {time.time() - t0:.0f} s\n")
    log(f"twin: built {venv} in {time.time() - t0:.0f} s")
    return exe


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("constraints", help="print the twin's constraints")
    env = sub.add_parser("env", help="build the twin venv (kept while its inputs are unchanged)")
    env.add_argument("--venv", type=pathlib.Path, default=VENV)
    env.add_argument("--python", default=None, help="a Python 3.12 (default: python3.12, else pyenv's)")
    args = p.parse_args(argv)
    if args.command == "constraints":
        sys.stdout.write(constraints())
        return 0
    build(args.venv, args.python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
