"""The lock (labkit/lock.txt) is what the environment running the tests holds, package for package."""
import pathlib
import platform
import re
import subprocess
import sys

import pytest
import torch

from labkit.cli import LOCK, lock_differences, read_lock

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_platform(text):
    """(system, machine, 'major.minor', torch version) from the lock's header line, as `make lock` writes it."""
    m = re.search(r"^# (\S+) (\S+) CPython (\d+\.\d+)\.\d+ with torch (\S+)$", text, re.M)
    assert m, "the lock's header names the platform it was verified on (make lock writes it)"
    return m.groups()


def test_lock_pins_every_line_and_torch_first():
    lines = [l for l in LOCK.read_text().splitlines() if l and not l.startswith("#")]
    assert lines[0] == "torch==2.13.0", "torch first, without a local build label (+cpu), as pip matches it"
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[^\s+]+", l) for l in lines), "name==version lines only"
    assert len(read_lock()) == len(lines) and "labkit" not in read_lock()


def test_lock_differences_match_like_pip(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("# a lock\ntorch==2.13.0\nPyYAML==6.0.4\n")
    assert lock_differences(lock, {"torch": "2.13.0+cu130", "pyyaml": "6.0.4"}) == []
    assert lock_differences(lock, {"torch": "2.9.1+cu128"}) == [("torch", "2.13.0", "2.9.1+cu128"),
                                                                  ("pyyaml", "6.0.4", None)]
    lock.write_text("torch>=2\n")
    with pytest.raises(ValueError, match="expected name==version, got 'torch>=2'"):
        read_lock(lock)


def test_environment_is_exactly_the_lock():
    """`pip freeze` of the environment make built (.venv, or make lock's) against the lock."""
    system, machine, python, torch_build = lock_platform(LOCK.read_text())
    here = (platform.system(), platform.machine(), "%d.%d" % sys.version_info[:2], torch.__version__)
    if sys.prefix == sys.base_prefix:
        pytest.skip(f"tests run from {sys.prefix}, not a venv that make installed from the lock; "
                    "`labkit doctor` lists how this environment differs from it")
    if here != (system, machine, python, torch_build):
        pytest.skip(f"the lock was verified on {system} {machine}, Python {python}, torch {torch_build}; this "
                    f"environment is {' '.join(here[:2])}, Python {here[2]}, torch {here[3]} (a GPU machine's "
                    "own torch, another Python): `labkit doctor` lists the differences")
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable",
                             "--disable-pip-version-check"], capture_output=True, text=True, check=True).stdout
    installed = {}
    for line in freeze.splitlines():
        name, _, version = line.partition("==")
        installed[_norm(name)] = version.split("+")[0]
    locked = read_lock()
    differ = {n: (v, installed.get(n)) for n, v in locked.items() if installed.get(n) != v}
    extra = sorted(set(installed) - set(locked))
    assert not differ and not extra, (
        f"this environment is not the lock: (locked, installed) {differ}; not in the lock: {extra}. "
        "`make env` installs the lock; after changing pyproject.toml, `make lock` makes a new one")
