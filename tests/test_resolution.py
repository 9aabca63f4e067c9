"""The lock resolves for every seat (labkit/scripts/check_resolution.py).

The checks against the package registry run where LABKIT_RESOLVE=1 (`make check-resolution`, which .ci/run
and the CI workflow call); elsewhere, `make test` offline, they are skipped with that reason. The helpers
they rest on are tested here offline.
"""
import os

import pytest

from labkit.cli import read_lock
from labkit.scripts import check_resolution as cr

ONLINE = os.environ.get("LABKIT_RESOLVE") == "1"
needs_registry = pytest.mark.skipif(not ONLINE, reason="asks the package registry: make check-resolution "
                                                       "(LABKIT_RESOLVE=1) runs it, as .ci/run does")


def test_there_are_twelve_seats():
    seats = [(p, v) for p in cr.PLATFORMS for v in cr.PYTHONS]
    assert len(seats) == 12 and {"macOS arm64", "Windows x86-64", "Linux aarch64", "Linux x86-64"} == set(cr.PLATFORMS)


def test_marker_environment_is_what_pip_sees_there():
    mac = cr.marker_environment("macOS arm64", "3.12")
    assert (mac["sys_platform"], mac["platform_machine"], mac["python_full_version"]) == ("darwin", "arm64", "3.12.0")
    # The lock's lines for each seat: triton and the CUDA libraries on Linux only, pywinpty on Windows only.
    linux = read_lock(environment=cr.marker_environment("Linux aarch64", "3.13"))
    windows = read_lock(environment=cr.marker_environment("Windows x86-64", "3.11"))
    assert "triton" in linux and "triton" not in windows and "pywinpty" in windows and "pywinpty" not in linux
    with pytest.raises(ValueError, match="platform must be one of .*'FreeBSD'"):
        cr.marker_environment("FreeBSD", "3.11")
    with pytest.raises(ValueError, match=r"python must be one of .*'3.10'"):
        cr.marker_environment("Linux x86-64", "3.10")


def test_compare_names_each_kind_of_disagreement():
    locked = {"torch": "2.13.0", "triton": "3.7.1", "pywinpty": "3.1.2"}
    assert cr.compare({"torch": "2.13.0", "triton": "3.7.1", "pywinpty": "3.1.2"}, locked) == []
    problems = cr.compare({"torch": "2.13.0", "triton": "3.9.0", "numpy": "2.4.6"}, locked)
    assert problems == ["triton resolved to 3.9.0, lock says 3.7.1",
                        "numpy==2.4.6 is not in the lock for this target",
                        "the lock's pywinpty==3.1.2 applies here but nothing needs it (its marker is too wide)"]


def test_parse_pins_reads_uv_output():
    out = "torch==2.13.0\ntriton==3.7.1 ; sys_platform == 'linux'\n    # via torch\nPyYAML==6.0.4\n"
    assert cr.parse_pins(out) == {"torch": "2.13.0", "triton": "3.7.1", "pyyaml": "6.0.4"}


def test_checks_ignore_this_machines_pip_settings(monkeypatch):
    """Local wheels (/opt/wheels), machine-wide constraints and indexes are what a learner's machine lacks."""
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels")
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/xdg/pip/constraints.txt")
    monkeypatch.setenv("UV_INDEX_URL", "file:///somewhere")
    env = cr.clean_env()
    assert "PIP_FIND_LINKS" not in env and "PIP_CONSTRAINT" not in env and "UV_INDEX_URL" not in env
    assert env["PIP_CONFIG_FILE"] == os.devnull              # no /etc/xdg/pip/pip.conf, no ~/.config/pip


@needs_registry
@pytest.mark.parametrize("platform", list(cr.PLATFORMS))
@pytest.mark.parametrize("python", cr.PYTHONS)
def test_lock_resolves_wheels_only(platform, python):
    ok, message = cr.check_uv(platform, python)
    assert ok, f"{platform}, Python {python}: {message}"


@needs_registry
def test_ordinary_linux_installs_the_lock_from_the_registry():
    """torch alone, then .[all], as `make env` does: the registry's CUDA torch and its own triton pin."""
    ok, message = cr.check_pip()
    assert ok, message


@needs_registry
def test_cpu_only_torch_route():
    """`make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu`: torch 2.13.0+cpu, no CUDA library."""
    ok, message = cr.check_cpu_torch()
    if ok is None:
        pytest.skip(message)
    assert ok, message
