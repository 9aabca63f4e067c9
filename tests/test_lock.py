"""The lock (labkit/lock.txt): universal, pip-readable, and what the environment running the tests holds."""
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from labkit.cli import LOCK, lock_differences, lock_lines, read_lock

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAC = {"sys_platform": "darwin", "platform_system": "Darwin", "platform_machine": "arm64", "os_name": "posix"}
WINDOWS = {"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64", "os_name": "nt"}
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix"}


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def test_lock_pins_every_line_and_torch_first():
    lines = [l for l in LOCK.read_text().splitlines() if l and not l.startswith("#")]
    assert lines[0] == "torch==2.13.0", "torch first, without a local build label (+cpu) or a marker, as pip matches it"
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[^\s+;]+( ; .+)?", l) for l in lines), "name==version [; marker] lines"
    assert len(lock_lines()) == len(lines) and "labkit" not in {n for n, _, _ in lock_lines()}


def test_lock_is_universal_with_torchs_own_triton_on_linux_only():
    """The registry's Linux torch 2.13.0 requires triton==3.7.1; macOS and Windows have no triton wheels."""
    linux, mac, windows = read_lock(environment=LINUX), read_lock(environment=MAC), read_lock(environment=WINDOWS)
    assert linux["triton"] == "3.7.1" and "triton" not in mac and "triton" not in windows
    assert linux["torch"] == mac["torch"] == windows["torch"] == "2.13.0"
    assert "nvidia-cublas" in linux and not any(n.startswith("nvidia-cu") for n in mac)  # CUDA libs: Linux only
    assert "pywinpty" in windows and "pywinpty" not in linux and "appnope" in mac           # each system its own
    for python in ("3.11", "3.12", "3.13"):
        assert read_lock(environment={**LINUX, "python_version": python, "python_full_version": f"{python}.9"})


def test_lock_markers_pick_the_line_for_each_python(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("torch==2.13.0\nsoupsieve==2.10 ; python_full_version < '3.11.5'\n"
                    "soupsieve==4.1.3 ; python_full_version >= '3.11.5'\ntriton==3.7.1 ; sys_platform == 'linux'\n")
    assert read_lock(lock, {**LINUX, "python_full_version": "3.11.2"}) == {
        "torch": "2.13.0", "soupsieve": "2.10", "triton": "3.7.1"}
    assert read_lock(lock, {**MAC, "python_full_version": "3.12.4"}) == {"torch": "2.13.0", "soupsieve": "4.1.3"}
    lock.write_text("numpy==2.4.6\nnumpy==2.2.0 ; sys_platform == 'linux'\n")
    with pytest.raises(ValueError, match="numpy is pinned to both 2.4.6 and 2.2.0.*overlap"):
        read_lock(lock, LINUX)
    lock.write_text("numpy==2.4.6 ; sys_platform = 'linux'\n")
    with pytest.raises(ValueError, match="bad environment marker"):
        read_lock(lock)


def test_lock_differences_match_like_pip(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("# a lock\ntorch==2.13.0\nPyYAML==6.0.4\ntriton==3.7.1 ; sys_platform == 'linux'\n")
    assert lock_differences(lock, {"torch": "2.13.0+cu130", "pyyaml": "6.0.4"}, MAC) == []
    assert lock_differences(lock, {"torch": "2.13.0+cu130", "pyyaml": "6.0.4"}, LINUX) == [("triton", "3.7.1", None)]
    assert lock_differences(lock, {"torch": "2.9.1+cu128"}, MAC) == [("torch", "2.13.0", "2.9.1+cu128"),
                                                                       ("pyyaml", "6.0.4", None)]
    # Missing counts only for what something here needs (a CPU-only torch needs no CUDA library, nor triton's pin).
    assert lock_differences(lock, {"torch": "2.13.0+cpu"}, LINUX, needed={"pyyaml"}) == [("pyyaml", "6.0.4", None)]
    lock.write_text("torch>=2\n")
    with pytest.raises(ValueError, match=r"expected name==version \[; marker\], got 'torch>=2'"):
        read_lock(lock)


def test_pip_reads_the_universal_lock_as_constraints(tmp_path):
    """pip itself (not only our parser) takes every line, markers included, and applies this machine's."""
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
                           "--quiet", "--disable-pip-version-check", "-c", str(LOCK), "pip"],
                          capture_output=True, text=True, env={"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "Invalid requirement" not in done.stderr, done.stderr[-2000:]


def _needed_here():
    """The distributions labkit[all] needs here, walked through what is installed (its torch's own requirements)."""
    seen, todo = set(), [("labkit", {"all"})]
    while todo:
        name, extras = todo.pop()
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for spec in map(Requirement, requires):
            wanted = [e for e in (extras or {""}) if spec.marker is None or spec.marker.evaluate({"extra": e})]
            if spec.marker is not None and not wanted:
                continue
            key = _norm(spec.name)
            if key == "labkit":
                todo.append(("labkit", set(spec.extras)))
            elif key not in seen:
                seen.add(key)
                todo.append((spec.name, set(spec.extras)))
    return seen


def test_environment_is_exactly_the_lock():
    """`pip freeze` of the environment make built (.venv, or make lock's) against the lock's lines for this machine.

    Every installed package is at the version the lock names here, and every package labkit[all] needs
    (through the installed torch's own requirements: the CUDA libraries only with a CUDA torch) is installed.
    """
    if sys.prefix == sys.base_prefix:
        pytest.skip(f"tests run from {sys.prefix}, not a venv that make installed from the lock; "
                    "`labkit doctor` lists how this environment differs from it")
    locked = read_lock()
    if Version(Version(torch.__version__).public) != Version(locked["torch"]):
        pytest.skip(f"torch {torch.__version__} here, the lock's is {locked['torch']} (a GPU machine's own torch): "
                    "`labkit doctor` lists the differences")
    try:
        importlib.metadata.requires("labkit")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("labkit is not installed here (imported from the folder): make env installs it from the lock")
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable",
                             "--disable-pip-version-check"], capture_output=True, text=True, check=True).stdout
    installed = {}
    for line in freeze.splitlines():
        name, _, version = line.partition("==")
        installed[_norm(name)] = version.split("+")[0]
    differ = {n: (locked.get(n), v) for n, v in installed.items() if n in locked and locked[n] != v}
    extra = sorted(set(installed) - set(locked))
    absent = sorted(_needed_here() - set(installed))
    assert not differ and not extra and not absent, (
        f"this environment is not the lock: (locked, installed) {differ}; not in the lock for this machine: {extra}; "
        f"needed and not installed: {absent}. `make env` installs the lock; after changing pyproject.toml, "
        "`make lock` makes a new one")
