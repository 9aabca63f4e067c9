"""Every notebook's full size fits a 24 GiB GPU (contract 1 of issue 25), checked on a CPU by the estimate.

Each notebook's parameters cell (its first code cell, tagged `parameters`) ends with
    FULL_STEPS = {"step name": dict(config=..., batch=..., seq=..., dtype=..., ...), "other": dict(bytes=...)}
    HEADROOM = 0.10
This test executes that cell with LABKIT_SIZE=full in a fresh process (one per notebook, a few at a time),
estimates each model entry with `lk.estimate(**entry, device="cuda")` (entries with `bytes` are taken as
given) and asserts that each step fits 24 GiB * (1 - HEADROOM): an out-of-memory error by design is
caught here, without a GPU.
"""
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CARD = 24 * 2**30                      # L4, A10, RTX 4090: the card a workshop can count on
GiB = 2**30

# Runs in the child: the parameters cell at full size (labkit.scripts.gpu_smoke.full_steps, which
# `make gpu-smoke` uses to run the same steps on a GPU), then each step's bytes. Prints one
# "FULL_PLAN {json}" line; whatever the cell prints itself comes before it.
_CHILD = r'''
import json, sys, traceback
def done(**out):
    print("FULL_PLAN " + json.dumps(out), flush=True)
    sys.exit(0)
from labkit.scripts.gpu_smoke import NoPlan, full_steps
try:
    steps, headroom = full_steps(sys.argv[1])
except NoPlan as e:
    done(error=str(e))
except BaseException:
    done(error="its parameters cell raised at LABKIT_SIZE=full:\n" + traceback.format_exc(limit=-3))
import labkit as lk
out = {}
for name, kw in steps.items():
    try:
        if not isinstance(kw, dict):
            raise TypeError(f"the entry must be a dict of lk.estimate keywords or dict(bytes=...), got {kw!r}")
        if "bytes" in kw:
            if set(kw) != {"bytes"}:
                raise ValueError(f"an entry with bytes holds nothing else, got keys {sorted(kw)}")
            out[str(name)] = dict(bytes=lk.parse_bytes(kw["bytes"], "bytes"), how="given")
        else:
            out[str(name)] = dict(bytes=int(lk.estimate(**{**kw, "device": "cuda"}).total), how="estimated")
    except Exception as e:
        out[str(name)] = dict(error=f"{type(e).__name__}: {e}")
done(steps=out, headroom=headroom)
'''


def plan(notebook):
    """The notebook's full-size steps, as the child process reports them (or {"error": why})."""
    env = {**os.environ, "LABKIT_SIZE": "full", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, str(notebook)], cwd=pathlib.Path(notebook).parent,
                             env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return dict(error="its parameters cell and estimates took over 300 s (they must be cheap: configs only)")
    lines = [line for line in run.stdout.splitlines() if line.startswith("FULL_PLAN ")]
    if not lines:
        return dict(error=f"the child process died (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return json.loads(lines[-1][len("FULL_PLAN "):])


def problems(notebook, result):
    """Every way the notebook's full size misses the 24 GiB card, one message each (empty: it fits)."""
    name = pathlib.Path(notebook).name
    if "error" in result:
        return [f"{name}: {result['error']}"]
    limit = CARD * (1 - result["headroom"])
    out = []
    for step, got in result["steps"].items():
        if "error" in got:
            out.append(f"{name}: step {step!r} could not be estimated: {got['error']}")
        elif got["bytes"] > limit:
            out.append(f"{name}: step {step!r} needs {got['bytes'] / GiB:.1f} GiB ({got['how']}), over the "
                       f"{limit / GiB:.1f} GiB limit (24 GiB with HEADROOM {result['headroom']:g} left free)")
    return out


class _Plans(dict):
    def __repr__(self):                # pytest prints a test's arguments: the notebook's name says enough
        return f"<plans of {len(self)} notebooks>"


@pytest.fixture(scope="module")
def plans():
    """Every notebook's plan, computed once, a few processes at a time (each imports torch: seconds)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return _Plans(zip(NOTEBOOKS, pool.map(plan, NOTEBOOKS)))


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 13, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_full_size_step_fits_a_24_gib_card(notebook, plans):
    found = problems(notebook, plans[notebook])
    assert not found, "\n".join(found)


# The checker itself, on toy notebooks: it must catch a step over budget and a notebook without a plan.

def _toy(tmp_path, source, tagged=True):
    import nbformat
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source)
    if tagged:
        cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# toy"), cell, nbformat.v4.new_code_cell("print('later')")]
    path = tmp_path / "99_toy.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_step_over_budget_is_named_with_its_gib_and_the_limit(tmp_path):
    """The 7B fp32 AdamW step is about 4 x 4 x 6.7e9 bytes = 100 GiB of states alone: far over 21.6 GiB."""
    path = _toy(tmp_path, "import labkit as lk\nSIZE = lk.size()\nFULL_STEPS = {\n"
                          "    'fits': dict(bytes='20 GiB'),\n"
                          "    'naive attention': dict(bytes=23 * 2**30),\n"
                          "    'training step': dict(config='llama-2-7b', batch=1, seq=512, dtype='fp32', optimizer='adamw'),\n"
                          "    'small step': dict(config='gpt2-124m', batch=1, seq=128, dtype='bf16', optimizer='adamw'),\n"
                          "}\nassert SIZE == 'full'\nHEADROOM = 0.10\n")
    result = plan(path)
    assert set(result["steps"]) == {"fits", "naive attention", "training step", "small step"}
    found = problems(path, result)
    assert len(found) == 2, found
    assert found[0] == ("99_toy.ipynb: step 'naive attention' needs 23.0 GiB (given), over the 21.6 GiB limit "
                        "(24 GiB with HEADROOM 0.1 left free)")
    assert found[1].startswith("99_toy.ipynb: step 'training step' needs ") and "(estimated)" in found[1]
    assert float(found[1].split(" needs ")[1].split(" GiB")[0]) > 100


def test_a_notebook_without_a_plan_fails_with_a_clear_message(tmp_path):
    found = problems("99_toy.ipynb", plan(_toy(tmp_path, "BATCH = 4\nHEADROOM = 0.1\n")))
    assert found == ["99_toy.ipynb: its parameters cell does not define FULL_STEPS (contract 1: FULL_STEPS = "
                     "{step: lk.estimate keywords or dict(bytes=...)}, HEADROOM = 0.10)"]
    found = problems("99_toy.ipynb", plan(_toy(tmp_path, "FULL_STEPS = {'x': dict(bytes=1)}\n", tagged=False)))
    assert found == ["99_toy.ipynb: its first code cell is not tagged `parameters`"]


def test_bad_entries_and_a_raising_cell_are_reported_not_skipped(tmp_path):
    found = problems("99_toy.ipynb", plan(_toy(tmp_path, "FULL_STEPS = {'x': dict(bytes=1, batch=2), "
                                                         "'y': dict(config='gpt2-124m', batchh=2)}\nHEADROOM = 1.5\n")))
    assert found == ["99_toy.ipynb: HEADROOM must be a fraction in [0, 1), got 1.5"]
    found = problems("99_toy.ipynb", plan(_toy(tmp_path, "FULL_STEPS = {'x': dict(bytes=1, batch=2), "
                                                         "'y': dict(config='gpt2-124m', batchh=2)}\nHEADROOM = 0.1\n")))
    assert len(found) == 2 and "an entry with bytes holds nothing else" in found[0]
    assert "'y' could not be estimated: TypeError" in found[1] and "batchh" in found[1]
    found = problems("99_toy.ipynb", plan(_toy(tmp_path, "raise RuntimeError('boom')\n")))
    assert len(found) == 1 and "raised at LABKIT_SIZE=full" in found[0] and "RuntimeError: boom" in found[0]
