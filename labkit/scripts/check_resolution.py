"""Does labkit/lock.txt install everywhere a learner may sit? Resolution checks against the package registry.

    python -m labkit.scripts.check_resolution [--lock FILE] [--only uv|pip|cpu-torch]

Three kinds of check, each printing one line and failing loudly:

- uv: for every platform in PLATFORMS and every Python in PYTHONS (12 combinations), the project's full
  requirement set (pyproject.toml with every extra, plus pip, as `make lock` compiles it) resolved with
  `uv pip compile --python-platform ... --only-binary :all:`, the lock as constraints. Wheels only: a
  seat has no compilers to build an sdist. The resolution must be exactly the lock's lines whose markers
  apply to that platform and Python: nothing missing from the lock, no line that applies and is unused.
- pip: an ordinary Linux machine, as `make env` installs (torch alone first, then `-e '.[all]'`), with
  the registry's torch (a CUDA build on Linux), no local wheels and no machine-wide pip configuration
  (PIP_CONFIG_FILE=/dev/null, no PIP_FIND_LINKS): `pip install --dry-run --ignore-installed --target`.
- cpu-torch: the first step of `make env TORCH_INDEX=https://download.pytorch.org/whl/cpu` (a Linux laptop
  without a GPU): torch alone from that index, no other: torch 2.13.0+cpu. Skipped where that index cannot be reached, unless
  LABKIT_REQUIRE_CPU_INDEX is set (GitHub's CI sets it: its runners reach the index).

Needs the network (PyPI); takes a minute or two with uv's cache cold. Exit 1 if any check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCK = ROOT / "labkit" / "lock.txt"
TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = "https://pypi.org/simple"
PYTHONS = ("3.11", "3.12", "3.13")
# uv's target triple and the marker variables pip sees there. torch 2.13's macOS wheels need macOS 14.
PLATFORMS = {
    "macOS arm64": ("aarch64-apple-darwin", dict(sys_platform="darwin", platform_system="Darwin",
                                                 platform_machine="arm64", os_name="posix")),
    "Windows x86-64": ("x86_64-pc-windows-msvc", dict(sys_platform="win32", platform_system="Windows",
                                                      platform_machine="AMD64", os_name="nt")),
    "Linux aarch64": ("aarch64-unknown-linux-gnu", dict(sys_platform="linux", platform_system="Linux",
                                                        platform_machine="aarch64", os_name="posix")),
    "Linux x86-64": ("x86_64-unknown-linux-gnu", dict(sys_platform="linux", platform_system="Linux",
                                                      platform_machine="x86_64", os_name="posix")),
}
MACOSX_DEPLOYMENT_TARGET = "14.0"
# What the project installs besides pyproject.toml's requirements (the Makefile upgrades pip to the lock's).
EXTRA_INPUT = "pip\n"


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def marker_environment(platform, python):
    """The environment-marker variables of one target, as packaging.markers evaluates them."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {sorted(PLATFORMS)}, got {platform!r}")
    if python not in PYTHONS:
        raise ValueError(f"python must be one of {PYTHONS}, got {python!r}")
    # uv resolves `--python-version 3.11` for 3.11.0, the oldest of that line.
    return {**PLATFORMS[platform][1], "python_version": python, "python_full_version": f"{python}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "implementation_version": f"{python}.0", "platform_release": "", "platform_version": "",
            "extra": ""}


def clean_env(**extra):
    """os.environ without the machine's pip and uv settings (local wheels, constraints, indexes)."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("PIP_") or k.startswith("UV_")) or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT",
                                                                          "UV_CACHE_DIR")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def uv_command():
    """How to run uv: the `uv` package's binary (the `test` extra pins it), else `uv` on PATH."""
    try:
        from uv import find_uv_bin
        return [find_uv_bin()]
    except (ImportError, FileNotFoundError):
        import shutil
        if shutil.which("uv"):
            return [shutil.which("uv")]
        raise SystemExit("uv is needed for the resolution checks: pip install uv (the `test` extra has it)")


def parse_pins(text):
    """{package: version} from `name==version` lines (uv's output), comments and markers dropped."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].split(";")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"expected name==version, got {line!r}")
            pins[_norm(name)] = version.strip()
    return pins


def compare(resolved, locked):
    """Problems (strings) between what a resolver chose and what the lock says for that target."""
    problems = [f"{n} resolved to {v}, lock says {locked[n]}" for n, v in sorted(resolved.items())
                if n in locked and locked[n] != v]
    problems += [f"{n}=={v} is not in the lock for this target" for n, v in sorted(resolved.items())
                 if n not in locked]
    problems += [f"the lock's {n}=={v} applies here but nothing needs it (its marker is too wide)"
                 for n, v in sorted(locked.items()) if n not in resolved]
    return problems


def check_uv(platform, python, lock=LOCK):
    """(ok, message): the full requirement set resolves, wheels only, for one platform and Python, to the lock."""
    from labkit.cli import read_lock
    triple = PLATFORMS[platform][0]
    cmd = [*uv_command(), "pip", "compile", str(ROOT / "pyproject.toml"), "-", "--all-extras", "--no-config",
           "--python-platform", triple, "--python-version", python, "--only-binary", ":all:",
           "-c", str(lock), "--no-header", "--no-annotate", "--index-url", PYPI]
    done = subprocess.run(cmd, input=EXTRA_INPUT, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=clean_env(MACOSX_DEPLOYMENT_TARGET=MACOSX_DEPLOYMENT_TARGET))
    if done.returncode:
        return False, f"does not resolve: {done.stderr.strip()[-1500:]}"
    resolved = parse_pins(done.stdout)
    problems = compare(resolved, read_lock(lock, marker_environment(platform, python)))
    if problems:
        return False, f"resolves, but not to the lock: {'; '.join(problems)}"
    return True, f"{len(resolved)} packages, all as locked (torch {resolved.get('torch')}, " \
                 f"triton {resolved.get('triton', 'none')})"


def pip_dry_run(requirements, lock=LOCK, index=None):
    """{package: version} that `pip install` would install into an empty folder, or raises with pip's words.
    index: that index alone, without dependencies (how `make env TORCH_INDEX=...` takes torch)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        where = ["--index-url", index, "--no-deps"] if index else ["--index-url", PYPI]
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--target", str(pathlib.Path(tmp) / "target"), "--report", str(report), *where,
               "-c", str(lock), *requirements]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=900)
        if done.returncode:
            raise RuntimeError(f"pip: {(done.stderr or done.stdout).strip()[-1500:]}")
        items = json.loads(report.read_text())["install"]
    return {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def check_pip(lock=LOCK):
    """(ok, message): this Linux machine installs as `make env` does, from the registry alone, to the lock."""
    from labkit.cli import read_lock
    if not sys.platform.startswith("linux"):
        return False, f"this check runs on Linux (it is {sys.platform})"
    try:
        first = pip_dry_run([TORCH], lock)
        then = pip_dry_run([TORCH, ".[all]"], lock)
    except RuntimeError as err:
        return False, str(err)
    then.pop("labkit", None)
    locked = {n: v for n, v in read_lock(lock).items() if n != "pip"}    # pip: `make env` upgrades it apart
    public = {n: v.split("+")[0] for n, v in then.items()}
    problems = compare(public, locked)
    if first.get("torch") != "2.13.0" or problems:
        return False, f"torch alone: {first.get('torch')}; with .[all]: {'; '.join(problems) or 'as locked'}"
    return True, (f"torch alone, then .[all]: {len(then)} packages, all as locked "
                  f"(torch {then['torch']}, triton {then.get('triton', 'none')})")


def index_reachable(url, timeout=15):
    try:
        urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout)
        return True
    except OSError:
        return False


def check_cpu_torch(lock=LOCK):
    """(ok or None for skipped, message): `make env TORCH_INDEX=<CPU index>` installs torch 2.13.0+cpu."""
    if not index_reachable(CPU_INDEX):
        if os.environ.get("LABKIT_REQUIRE_CPU_INDEX"):     # set where the index must be reachable (GitHub's CI)
            return False, f"{CPU_INDEX} cannot be reached (and LABKIT_REQUIRE_CPU_INDEX is set: it must be)"
        return None, f"skipped: {CPU_INDEX} cannot be reached from here"
    try:
        got = pip_dry_run([TORCH], lock, index=CPU_INDEX)
    except RuntimeError as err:
        return False, str(err)
    if got != {"torch": "2.13.0+cpu"}:
        return False, f"from {CPU_INDEX} alone, without dependencies: {got}"
    return True, f"torch {got['torch']} from {CPU_INDEX} alone (its dependencies then come from the registry)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lock", type=pathlib.Path, default=LOCK)
    parser.add_argument("--only", choices=["uv", "pip", "cpu-torch"], default=None)
    args = parser.parse_args(argv)
    results = []
    if args.only in (None, "uv"):
        for platform in PLATFORMS:
            for python in PYTHONS:
                results.append((f"uv   {platform:<15} Python {python}", *check_uv(platform, python, args.lock)))
                print(f"{'ok  ' if results[-1][1] else 'FAIL'} {results[-1][0]}: {results[-1][2]}", flush=True)
    if args.only in (None, "pip"):
        results.append(("pip  this Linux, registry torch", *check_pip(args.lock)))
        print(f"{'ok  ' if results[-1][1] else 'FAIL'} {results[-1][0]}: {results[-1][2]}", flush=True)
    if args.only in (None, "cpu-torch"):
        results.append(("pip  this Linux, CPU-only torch", *check_cpu_torch(args.lock)))
        ok = results[-1][1]
        print(f"{'ok  ' if ok else 'skip' if ok is None else 'FAIL'} {results[-1][0]}: {results[-1][2]}", flush=True)
    failed = [name for name, ok, _ in results if ok is False]
    print(f"{len(results) - len(failed)} of {len(results)} resolution checks passed"
          + (f"; failed: {', '.join(n.split(None, 1)[1].strip() for n in failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
