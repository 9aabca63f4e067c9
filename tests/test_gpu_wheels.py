"""`make gpu-wheels` (labkit/scripts/gpu_wheels.py): what a GPU machine without a network is given.

The folder itself is made by `make gpu-wheels` (it needs the registry; .ci/run makes it). Where it exists,
it is installed offline (`pip install --no-index`) into a clean Python 3.12 venv beside a stand-in for
the GPU image: the twin's own copies (`make test-twin`: Python 3.12, torch 2.11, the image's versions)
of the packages data/gpu/image.txt names, and nothing else of the twin. A notebook then runs there
under nbval as `make test-gpu` runs one: the runner, the kernel and the packages the workbook needs all
come from the folder or the image. Without the folder (or the twin) those tests are skipped, saying so;
the helpers they rest on are tested here always.
"""
import json
import os
import pathlib
import subprocess
import sys
import zipfile

import nbformat
import pytest

from labkit.scripts import gpu_wheels as gw

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHEELS = pathlib.Path(os.environ.get("LABKIT_GPU_WHEELS", ROOT / "build" / "gpu-wheels"))
TWIN = pathlib.Path(os.environ.get("LABKIT_TWIN", ROOT / "build" / "twin"))
needs_wheels = pytest.mark.skipif(not (WHEELS / "MANIFEST.txt").exists(),
                                  reason=f"{WHEELS} is not there: `make gpu-wheels` makes it (it needs the registry; "
                                         ".ci/run does)")


def _wheel(folder, name, version, requires=()):
    """A minimal wheel file: its METADATA holds the Requires-Dist lines."""
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_unmet_names_what_neither_the_folder_nor_the_image_has(tmp_path):
    _wheel(tmp_path, "nbval", "0.11.0", ["pytest>=7", "ipykernel", "jupyter-client", 'colorama; sys_platform == "win32"'])
    _wheel(tmp_path, "ipykernel", "7.4.0", ["traitlets>=5.4"])
    _wheel(tmp_path, "transformers", "5.24.0", ["huggingface-hub>=2.0", "numpy>=1.17", "torch>=2.4; extra == 'torch'"])
    image = {"pytest": None, "numpy": "2.5.2", "huggingface-hub": "1.33.0"}
    assert gw.unmet(tmp_path, image) == [
        ("ipykernel", "traitlets>=5.4", "neither the folder nor the image has traitlets"),
        ("nbval", "jupyter-client", "neither the folder nor the image has jupyter-client"),
        ("transformers", "huggingface-hub>=2.0", "the image has huggingface-hub 1.33.0")]
    _wheel(tmp_path, "traitlets", "5.16.1")
    _wheel(tmp_path, "jupyter_client", "8.10.0")
    _wheel(tmp_path, "huggingface_hub", "2.4.0")
    assert gw.unmet(tmp_path, image) == []                    # the folder's own hf-hub shadows the image's


def test_the_image_list_and_the_lock_read_as_the_gpu_machine_sees_them():
    image = gw.read_image()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0" and image["pytest"] is None
    assert not {"nbval", "ipykernel", "ipython", "jupyter-client"} & set(image)     # what the image lacks
    lock = gw.read_lock()
    assert lock["transformers"] and "pywinpty" not in lock and "appnope" not in lock      # Linux lines only


@needs_wheels
def test_the_folder_meets_every_requirement_and_fits_with_the_tree():
    done = subprocess.run([sys.executable, ROOT / "labkit" / "scripts" / "gpu_wheels.py", "--check", WHEELS],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    names = {gw.canonicalize_name(gw.parse_wheel_filename(w.name)[0]) for w in WHEELS.glob("*.whl")}
    assert set(gw.CARRIED) <= names and not {"torch", "triton", "numpy"} & names
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl")) + gw.tree_bytes()
    assert size < 64 * 2**20, f"{size / 2**20:.1f} MiB travel with the tree"


def _image_stand_in(folder):
    """A folder of links to the twin's copies of the image's packages (and theirs alone): the GPU image
    as far as a CPU holds it."""
    listing = subprocess.run([TWIN / "bin" / "python", "-c", """
import importlib.metadata as m, json
out = {}
for d in m.distributions():
    tops = {str(f).split("/")[0] for f in (d.files or []) if not str(f).startswith("..")}
    out[d.metadata["Name"]] = [str(d.locate_file(t)) for t in tops]
print(json.dumps(out))
"""], capture_output=True, text=True, check=True).stdout
    image = gw.read_image()
    folder.mkdir()
    for name, paths in json.loads(listing).items():
        if gw.canonicalize_name(name) in image:
            for path in map(pathlib.Path, paths):
                link = folder / path.name
                if path.exists() and not link.exists() and path.name != "bin":
                    link.symlink_to(path)
    return folder


NOTEBOOK = """
import importlib.metadata, pathlib, sys
import torch, transformers, onnxruntime, accelerate, nbval, ipykernel, IPython
from IPython.display import display
import labkit as lk
assert transformers.__version__ == {transformers!r}, transformers.__version__        # the folder's, not the image's
assert torch.__version__.startswith("2.11.0"), torch.__version__                      # the image's
assert pathlib.Path(ipykernel.__file__).is_relative_to({site!r}), ipykernel.__file__
assert lk.models.config("llama-2-7b", "tiny").num_hidden_layers > 0
display("ran")
"""


@needs_wheels
@pytest.mark.skipif(not (TWIN / "bin" / "python").exists(),
                    reason=f"no twin at {TWIN} to stand in for the GPU image: `make test-twin` builds it")
def test_the_folder_installs_offline_into_a_clean_python_312_and_runs_a_notebook(tmp_path):
    from labkit.scripts.twin import find_python
    clean = tmp_path / "clean"
    subprocess.run([find_python(), "-m", "venv", clean], check=True)
    offline = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    site = tmp_path / "site"
    subprocess.run([clean / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", site, *WHEELS.glob("*.whl")], check=True, env=offline, timeout=600)
    image = _image_stand_in(tmp_path / "image")
    lock = gw.read_lock()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(NOTEBOOK.format(transformers=lock["transformers"], site=str(site)))]
    nbformat.write(nb, tmp_path / "carried.ipynb")
    env = {**offline, "PYTHONPATH": os.pathsep.join(map(str, [site, image, ROOT])), "HF_HUB_OFFLINE": "1",
           "MPLBACKEND": "Agg", "LABKIT_SIZE": "tiny", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([clean / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
                          "--nbval-current-env", tmp_path / "carried.ipynb"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
    # make test-gpu's own pre-flight there: nothing is missing; only the GPU itself is (this is a CPU).
    check = subprocess.run([clean / "bin" / "python", ROOT / "labkit" / "scripts" / "check_python.py", "test-gpu"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 2 and check.stdout.startswith("make test-gpu needs a CUDA GPU"), check.stdout
