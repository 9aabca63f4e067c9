"""Notebooks 08 and 12 run, and assert, on a machine without triton (macOS, Windows: no wheels there).

tests/no_triton/sitecustomize.py hides triton from every Python process started with that folder first
on PYTHONPATH: `importlib.util.find_spec("triton")` is None and `import triton` raises
ModuleNotFoundError. The notebooks then run through nbval (the repository's conftest fails any cell that
writes to stderr), and tests/no_triton/no_triton_outputs.py saves what each cell printed, so this test
can check that the PyTorch twins ran and asserted: their check lines are there, and nothing that needs
triton was skipped except the compiled kernels themselves.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NO_TRITON = ROOT / "tests" / "no_triton"

# Per notebook: lines the twins print once their asserts passed (regular expressions, each must match some
# output line). A section may say "Skipped: ... It needs triton" only if it is a compiled kernel itself, and
# it says so, naming its twin: "Skipped: the Triton matmul kernel itself (its PyTorch twin ...)".
NOTEBOOKS = {
    "08_flash_attention": dict(
        ran=[r"^ torch flash_attention torch\.float32\s+causal=True : matches SDPA",
             r"^ torch flash_attention torch\.bfloat16\s+causal=True : matches SDPA",
             r"^ torch torch\.float32\s+dq: max abs error",                  # the backward from the log-sum-exp
             r"^ torch torch\.bfloat16\s+dv: max abs error",
             r"^ torch: held for backward at N = \d+: .* = O .* \+ log-sum-exp",
             r"^ torch: one query against \d+ cached tokens: .*== dense attention",   # flash-decoding
             r"^ torch: block tables .*paged attention == dense attention",           # paged attention
             r"^flash twin \(PyTorch\)\s+exponent",
             r"^flash   : bytes ~ N\^",                                      # HBM traffic counted, exponents fitted
             r"^  summed / blocks\s+\d",                                    # the seed's per-block softmax, measured
             r"^Exercise 1: passed", r"^Exercise 2: passed", r"^Exercise 3: passed"]),
    "12_profiling_and_kernels": dict(
        ran=[r"^GROUP_M = 3: programs 0-8 compute tiles",                      # the grouped program order
             r"^GROUP_M = 3: twin == torch\.matmul",                           # the twin runs it, and reads fewer panels
             r"twin \(PyTorch\) == torch\.matmul",                            # square, ragged, bf16
             r"^chunked \(torch\)\s+== F\.cross_entropy",                      # the chunked cross-entropy
             r"^online \(torch twin\)\s+== F\.cross_entropy",                  # the fused kernel's algorithm
             r"^online\s+forward: extra peak",                                 # ... holds only tiles
             r"the twin in fp32 errs .* in TF32",                              # TF32 measured on the twin
             r"^slow step: \d+ aten::item calls; \d+ read AdamW's step counters",  # which calls would wait
             r"^AUTOGRAD_DETAIL\s+\d+ tensors",                              # the profiler's categories at the peak
             r"^Exercise 1: passed", r"^Exercise 2: passed"]),
}
SKIPPED = re.compile(r"^Skipped: (.*)\. It needs (.*), which this machine does not have\.$")
KERNEL_ITSELF = re.compile(r" itself \(its PyTorch twin [^)]*\)$")


def env_without_triton(**extra):
    pythonpath = os.pathsep.join(filter(None, [str(NO_TRITON), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, "LABKIT_SIZE": "tiny", "OMP_NUM_THREADS": "1",
            "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


PROBE = """
import importlib.util, sys
assert importlib.util.find_spec("triton") is None, "find_spec sees triton"
try:
    import triton
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("import triton succeeded")
import torch                                    # torch probes for triton itself: it must still work
x = torch.randn(4, 4)
assert torch.allclose(torch.compile(lambda a: a @ a, backend="eager")(x), x @ x)
import labkit as lk
from labkit import flash
assert lk.has("triton") is False and "triton" not in sys.modules
q = torch.randn(1, 2, 8, 32)
assert flash.flash_attention(q, q, q).shape == q.shape          # "auto" falls back to the twin
print("hidden")
"""


def test_the_hook_hides_triton_and_torch_still_works():
    run = subprocess.run([sys.executable, "-c", PROBE], env=env_without_triton(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "hidden", run.stderr[-3000:]


@pytest.mark.parametrize("notebook", sorted(NOTEBOOKS))
def test_notebook_runs_and_its_twins_assert_without_triton(notebook, tmp_path):
    outputs = tmp_path / "cells.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no_triton_outputs", "--nbval-lax",
         "--nbval-cell-timeout=300", str(ROOT / "notebooks" / f"{notebook}.ipynb")],
        env=env_without_triton(LABKIT_CELL_OUTPUTS=str(outputs)), cwd=ROOT, capture_output=True, text=True,
        timeout=900)
    assert run.returncode == 0, f"nbval failed without triton:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    cells = [json.loads(line) for line in outputs.read_text().splitlines()]
    assert cells and all(cell["passed"] for cell in cells)
    found = problems(notebook, [line for cell in cells for line in cell["text"].splitlines()])
    assert not found, "\n".join(found)


def problems(notebook, lines):
    """What the printed lines show went wrong without triton: a twin's check line missing, or a section
    skipped for want of triton that is not one of the kernels themselves (empty: all is well)."""
    missing = [pattern for pattern in NOTEBOOKS[notebook]["ran"] if not any(re.search(pattern, line) for line in lines)]
    skipped = [m.groups() for m in map(SKIPPED.match, lines) if m]
    needing_triton = {section for section, needs in skipped if "triton" in needs.split(", ") and "cuda" not in needs}
    out = [f"{notebook}: the twins' check line {pattern!r} is missing" for pattern in missing]
    return out + [f"{notebook}: {section!r} was skipped for want of triton, and it is not a kernel itself "
                  f"naming its twin ('... itself (its PyTorch twin ...)')"
                  for section in sorted(needing_triton) if not KERNEL_ITSELF.search(section)]


def test_the_checker_catches_a_missing_twin_and_a_skipped_section():
    """The check itself, on printed lines like 08's: they pass; one line missing, or one section more
    skipped for want of triton, is reported (a section that also needs CUDA may be skipped)."""
    lines = [" torch flash_attention torch.float32   causal=True : matches SDPA (tolerance 1e-05)",
             " torch flash_attention torch.bfloat16  causal=True : matches SDPA (tolerance 0.02)",
             " torch torch.float32   dq: max abs error 9.8e-07   (SDPA in float32: 9.8e-07; largest |dq| 1.0)",
             " torch torch.bfloat16  dv: max abs error 6.1e-03   (SDPA in bfloat16: 6.9e-03; largest |dv| 1.0)",
             " torch: held for backward at N = 145: 147.27 KiB = O 145.00 KiB + log-sum-exp 2.27 KiB; P would be 1 MiB",
             " torch: one query against 1024 cached tokens: 4 programs in the forward kernel's grid, 32 when "
             "split over the keys (8 splits of 128); == dense attention",
             " torch: block tables {'a': [0, 1]}, lengths [20]: 2 blocks in use for 20 tokens; paged attention == dense attention",
             "flash twin (PyTorch)   exponent 1.00     1.01 MiB    0.9ms",
             "flash   : bytes ~ N^+1.92 d^+1.90 M^-0.92   (Theorem 2: N^+2 d^+2 M^-1)",
             "  summed / blocks                    5.0e-01",
             "Exercise 1: passed", "Exercise 2: passed", "Exercise 3: passed",
             "Skipped: the Triton kernel itself (its PyTorch twin runs every check). It needs triton, which this "
             "machine does not have.",
             "Skipped: the TFLOP/s. It needs cuda, triton, which this machine does not have."]
    assert problems("08_flash_attention", lines) == []
    assert problems("08_flash_attention", [x for x in lines if "paged" not in x]) == [
        "08_flash_attention: the twins' check line '^ torch: block tables .*paged attention == dense attention' is missing"]
    lines.append("Skipped: the decoding kernels. It needs triton, which this machine does not have.")
    assert problems("08_flash_attention", lines) == [
        "08_flash_attention: 'the decoding kernels' was skipped for want of triton, and it is not a kernel itself "
        "naming its twin ('... itself (its PyTorch twin ...)')"]
