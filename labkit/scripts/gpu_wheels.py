"""`make gpu-wheels`: the wheels a GPU machine without a network needs for `make test-gpu`, in one folder.

    python labkit/scripts/gpu_wheels.py [--dest build/gpu-wheels] [--limit-mib 64]
    python labkit/scripts/gpu_wheels.py --check DIR     # offline: is every requirement of DIR's wheels met?

The GPU image (data/gpu/image.txt) has torch, triton, transformers 5.17 and pytest, and lacks what runs
notebooks: nbval, ipykernel and IPython. This gathers, for CPython 3.12 on Linux x86-64, at the lock's
versions: the nbval runner with ipykernel and IPython, transformers (the lock's: the version `make test`
checks), onnxruntime and accelerate, bitsandbytes where it fits; then every package they require that the
image lacks, or has at a version they do not accept. Wheels only, from the registry alone (as a
learner's pip: no local wheels, no machine-wide configuration). The folder and the repository's tree
travel together to the GPU machine, so their sum must stay under --limit-mib (64): an optional wheel that
does not fit is left out, saying so. DIR/MANIFEST.txt lists the wheels, their sizes and what was taken as
given on the image.

On the GPU machine (README, "On a GPU"): `make test-gpu PYTHON=python3 WHEELS=build/gpu-wheels` installs
them offline (`pip install --no-index --no-deps --target build/gpu-site`) and puts that folder first on
PYTHONPATH.
"""
from __future__ import annotations

import argparse
import email.parser
import os
import pathlib
import re
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCK = ROOT / "labkit" / "lock.txt"
IMAGE = ROOT / "data" / "gpu" / "image.txt"
DEST = ROOT / "build" / "gpu-wheels"
PYTHON = "3.12"
# Each carried whatever the image holds (the runner and the packages the workbook is checked with), then
# the optional ones, left out in this order where the folder would not fit.
CARRIED = ("nbval", "ipykernel", "ipython", "transformers", "onnxruntime", "accelerate")
OPTIONAL = ("bitsandbytes",)
# Never carried: torch's own stack is the image's (a CUDA build of several GB).
TORCH_STACK = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|setuptools|pip)$")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64",
                                                                                      "manylinux1_x86_64"]
# The marker environment of the GPU machine (Python 3.12 on Linux x86-64), for requirements' markers.
MARKERS = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _clean_env():
    from labkit.scripts.check_resolution import clean_env
    return clean_env()


def read_image(path=IMAGE):
    """{name: version or None} of data/gpu/image.txt: what the GPU image holds (None: a version nobody read)."""
    out = {}
    for raw in pathlib.Path(path).read_text().splitlines():
        for item in raw.split("#")[0].split():            # name==version, or several bare names on a line
            name, _, version = item.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def read_lock(path=LOCK):
    """{name: version} of the lock's lines for the GPU machine (Python 3.12, Linux x86-64)."""
    from packaging.markers import Marker
    out = {}
    for line in pathlib.Path(path).read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        pin, _, marker = line.partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate(MARKERS):
            continue
        name, _, version = pin.strip().partition("==")
        out[canonicalize_name(name)] = version
    return out


def requires(wheel):
    """The requirements of a wheel (its METADATA's Requires-Dist) that apply on the GPU machine, extras aside."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(z.read(meta).decode())
    out = []
    for spec in message.get_all("Requires-Dist") or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate(MARKERS):
            out.append(req)
    return out


def unmet(folder, image):
    """[(wheel's package, requirement, why)] for every requirement of the folder's wheels that neither a
    wheel in the folder nor the image meets (an image package of unknown version is taken to meet it)."""
    wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): (w, parse_wheel_filename(w.name)[1])
              for w in pathlib.Path(folder).glob("*.whl")}
    problems = []
    for name, (wheel, _) in sorted(wheels.items()):
        for req in requires(wheel):
            want = canonicalize_name(req.name)
            if want in wheels:
                have = wheels[want][1]
                if not req.specifier.contains(have, prereleases=True):
                    problems.append((name, str(req), f"the folder has {want} {have}"))
            elif want in image:
                if image[want] and not req.specifier.contains(Version(image[want]), prereleases=True):
                    problems.append((name, str(req), f"the image has {want} {image[want]}"))
            else:
                problems.append((name, str(req), f"neither the folder nor the image has {want}"))
    return problems


def download(names, lock, dest):
    """pip download, wheels only, for CPython 3.12 on Linux x86-64, each at the lock's version, no deps."""
    pins = [f"{n}=={lock[n]}" for n in names]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           PYTHON, "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", *platforms,
           "--index-url", "https://pypi.org/simple", "-d", str(dest), *pins]
    subprocess.run(cmd, check=True, env=_clean_env())


def tree_bytes(root=ROOT):
    """What travels with the wheels: the repository's tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, capture_output=True,
                            check=True).stdout.split(b"\0")
    return sum((root / os.fsdecode(n)).stat().st_size for n in listed if n and (root / os.fsdecode(n)).is_file())


def gather(dest=DEST, limit_mib=64, lock_path=LOCK, image_path=IMAGE, log=print):
    """Fill `dest` (emptied first) and write its MANIFEST.txt; returns the wheels' paths."""
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    lock, image = read_lock(lock_path), read_image(image_path)
    wanted = [n for n in (*CARRIED, *OPTIONAL) if n in lock]
    download(wanted, lock, dest)
    while True:                               # what the carried wheels require and the image lacks
        missing = sorted({canonicalize_name(Requirement(req).name) for _, req, _ in unmet(dest, image)})
        missing = [n for n in missing if not TORCH_STACK.match(n)]
        if not missing:
            break
        absent = [n for n in missing if n not in lock]
        if absent:
            raise SystemExit(f"gpu-wheels: {', '.join(absent)} required but not in the lock for Python {PYTHON} "
                             f"on Linux x86-64: run `make lock`")
        log(f"gpu-wheels: also {', '.join(missing)} (required, and the image lacks them or has other versions)")
        download(missing, lock, dest)
    tree = tree_bytes()
    limit = limit_mib * 2**20
    left_out = []
    for name in OPTIONAL:                     # largest luxury first: leave it out if the folder does not fit
        size = sum(w.stat().st_size for w in dest.glob("*.whl"))
        if tree + size <= limit:
            break
        wheel = next((w for w in dest.glob("*.whl") if canonicalize_name(parse_wheel_filename(w.name)[0]) == name), None)
        if wheel is not None:
            left_out.append(f"{wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
            wheel.unlink()
    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    problems = [p for p in unmet(dest, image) if not TORCH_STACK.match(canonicalize_name(Requirement(p[1]).name))]
    if tree + size > limit or problems:
        raise SystemExit(f"gpu-wheels: {size / 2**20:.1f} MiB of wheels + {tree / 2**20:.1f} MiB of tree "
                         f"(limit {limit_mib} MiB); unmet: {problems}")
    taken = sorted({canonicalize_name(Requirement(r).name) for w in wheels for r in map(str, requires(w))}
                   - {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels})
    lines = [f"# make gpu-wheels: {len(wheels)} wheels, {size / 2**20:.1f} MiB (+ the tree's {tree / 2**20:.1f} MiB "
             f"= {(size + tree) / 2**20:.1f} of {limit_mib} MiB), CPython {PYTHON}, Linux x86-64, the lock's versions.",
             "# Install offline on the GPU machine: make test-gpu PYTHON=python3 WHEELS=<this folder>",
             f"# Taken as given on the image (data/gpu/image.txt): {', '.join(taken)}",
             *(f"# Left out (the folder would not fit): {w}" for w in left_out),
             *(f"{w.name}  {w.stat().st_size / 2**20:.2f} MiB" for w in wheels)]
    (dest / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    log("\n".join(lines[:4 + len(left_out)]))
    return wheels


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", type=pathlib.Path, default=DEST)
    p.add_argument("--limit-mib", type=float, default=64)
    p.add_argument("--check", type=pathlib.Path, default=None, metavar="DIR",
                   help="offline: list every requirement of DIR's wheels that neither DIR nor the image meets")
    args = p.parse_args(argv)
    if args.check:
        problems = [x for x in unmet(args.check, read_image()) if not TORCH_STACK.match(canonicalize_name(Requirement(x[1]).name))]
        for name, req, why in problems:
            print(f"{name} requires {req}: {why}")
        return 1 if problems else 0
    gather(args.dest, args.limit_mib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
