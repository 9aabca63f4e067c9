"""Can this Python run `make test-gpu` / `make gpu-smoke`? One clear line instead of a traceback.

    PYTHON labkit/scripts/check_python.py test-gpu|gpu-smoke

Run as a file (not `-m labkit...`): importing labkit would import torch and transformers, which is
what is being checked. Checks, in order: torch is installed; for test-gpu, torch sees a CUDA GPU
(gpu-smoke says so itself and exits 2); the packages the notebooks and tests need are installed
for test-gpu (pyproject.toml's dependencies, pytest, nbval, ipykernel; gpu-smoke needs only torch
and says itself what a check lacks); labkit is found from this folder (the Makefile puts it on
PYTHONPATH). Optional extras that are missing are named, not fatal.
Exit 0 if the target can run, 2 with the reason otherwise.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS = ("test-gpu", "gpu-smoke")
# Beyond pyproject's dependencies: what `make test-gpu` runs with (pytest, nbval and a kernel for the notebooks;
# `make gpu-wheels` carries them to a GPU image that lacks them).
NEEDED = {"test-gpu": ["pytest", "nbval", "ipykernel", "nbformat"], "gpu-smoke": []}
OPTIONAL_EXTRAS = ("lab", "models", "quant", "kernels", "deploy", "gpu")


def missing(requirements):
    """The requirements (strings) whose distribution is not installed here (markers that do not apply: skipped)."""
    import re
    try:
        from packaging.requirements import Requirement
    except ImportError:                                   # a bare Python: names only, markers taken as true
        Requirement = None
    absent = []
    for spec in requirements:
        req = Requirement(spec) if Requirement else None
        name = req.name if req else re.match(r"[A-Za-z0-9_.-]+", spec).group(0)
        if name == "labkit" or (req and req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    return absent


def check(target, python=sys.executable):
    """(exit code, lines to print) for running `target` with this interpreter."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    here = f"make {target} PYTHON={python}"
    if importlib.util.find_spec("torch") is None:
        return 2, [f"{python} has no torch: run 'make env' first (it builds .venv), or name a Python that has a "
                   f"CUDA torch: make {target} PYTHON=python3"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # gpu-smoke runs on a machine with only a CUDA torch (no network) and names what each check lacks itself.
    required = project["dependencies"] if target == "test-gpu" else []
    absent = missing(required) + [n for n in NEEDED[target] if missing([n])]
    if absent:
        return 2, [f"{here}: this Python lacks {', '.join(absent)}. Install them beside its torch (keeping it):",
                   f"  {python} -m pip install -c labkit/lock.txt {' '.join(absent)}"]
    import torch
    if target == "test-gpu" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return 2, [f"make test-gpu needs a CUDA GPU, and torch {torch.__version__} ({build}) sees none here. "
                   "Use 'make test' for the tiny size on a CPU."]
    if importlib.util.find_spec("labkit") is None:
        return 2, [f"{here}: labkit is not importable (run from {ROOT}: the Makefile puts it on PYTHONPATH)"]
    lines = []
    for extra in OPTIONAL_EXTRAS:
        gone = missing(project["optional-dependencies"][extra])
        if gone:
            lines.append(f"note: without {', '.join(gone)} (labkit[{extra}]) some notebook sections are skipped; "
                         f"`labkit doctor` says which")
    return 0, lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in TARGETS:
        print(f"usage: PYTHON labkit/scripts/check_python.py {'|'.join(TARGETS)}", file=sys.stderr)
        return 2
    code, lines = check(argv[0])
    for line in lines:
        print(line)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
