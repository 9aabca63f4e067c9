"""Notebooks 08 and 12 show the code they teach with lk.show and call only public labkit names; the
launch-parameter sweep of 12 runs on a GPU only (checks on the notebooks' source, no execution)."""
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = ["08_flash_attention", "12_profiling_and_kernels"]
PRIVATE = re.compile(r"\b(?:lk|flash|flash_triton|kernels|profiling)\.(_[A-Za-z]\w*)")


def code(name):
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_taught_code_is_shown_with_lk_show_not_inspect(name):
    sources = code(name)
    assert not [s for s in sources if "inspect.getsource" in s or "Code(" in s]
    assert any("lk.show(" in s for s in sources)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_no_private_labkit_name_is_called_or_shown(name):
    found = [m.group(0) for s in code(name) for m in PRIVATE.finditer(s)]
    assert not found, found


def test_the_private_name_check_finds_what_it_should():
    assert PRIVATE.search("lk.show(flash._flash_fwd.fn)") and PRIVATE.search("profiling._coalesce(t)")
    assert not PRIVATE.search("lk.show(flash.kernel_code('forward'))") and not PRIVATE.search("x.__class__")


def test_the_launch_parameter_sweep_runs_only_under_a_cuda_guard():
    cell = next(s for s in code("12_profiling_and_kernels") if "num_stages=stages" in s)
    guard = cell.index('lk.requires("cuda", "triton"')
    assert guard < cell.index("num_stages=stages") and cell.index("assert launch[best]") > guard


def test_the_parameters_cell_of_12_needs_no_ipython():
    """gpu-smoke runs 12's parameters cell on an image without IPython (issue 36, defect 4)."""
    cells = json.loads((ROOT / "notebooks" / "12_profiling_and_kernels.ipynb").read_text())["cells"]
    parameters = next(c for c in cells if "parameters" in c["metadata"].get("tags", []))
    assert "IPython" not in "".join(parameters["source"])


@pytest.mark.parametrize("name", ["11_compile_and_engines", "12_profiling_and_kernels"])
def test_tf32_is_switched_through_one_api(name):
    """Setting torch.backends.cuda.matmul.fp32_precision alone mixes the legacy and new APIs (issue 36, defect 3)."""
    assert not [s for s in code(name) if "fp32_precision =" in s or "allow_tf32 =" in s]
