"""Every notebook's full size fits a 24 GiB GPU (contract 1 of issue 25), checked on a CPU by the estimate.

Each notebook's parameters cell (its first code cell, tagged `parameters`) ends with
    FULL_STEPS = {"step name": dict(config=..., batch=..., seq=..., dtype=..., ..., beside={"what": bytes}),
                  "other": dict(bytes=...)}
This test executes that cell with LABKIT_SIZE=full in a fresh process (one per notebook, a few at a time),
estimates each model entry with `lk.estimate(**entry, device="cuda")` (entries with `bytes` are taken as
given), adds what the entry's `beside` says stays alive on the device beside the step (another model, a copy of
the gradients), and asserts that each step fits lk.CARD * (1 - lk.HEADROOM) = 21.6 GiB: an out-of-memory
error by design is caught here, without a GPU. The headroom is labkit's, not the notebook's.

A declaration can forget what a cell keeps alive. For the notebooks in CELLS_CHECKED the test also runs the
notebook at tiny size (the same code as at full size, on the CPU) and counts, cell by cell, the peak of the
real tensor bytes alive (those made before the cell and those it makes; fake and meta tensors are shapes, not
memory, and numpy buffers are the host): no cell may hold more than the largest FULL_STEPS entry, evaluated at
tiny size, allows.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from labkit.device import CARD, HEADROOM, LIMIT

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
GiB = 2**30

# Runs in the child, for each notebook named on its command line: the parameters cell at full size
# (labkit.scripts.gpu_smoke.full_steps, which `make gpu-smoke` uses to run the same steps on a GPU), then each
# step's bytes. Prints one "FULL_PLAN {json}" line per notebook; whatever a cell prints itself comes before it.
# One process for all of them: importing torch and transformers once, not once per notebook.
_CHILD = r"""
import json, sys, traceback
from labkit.scripts.gpu_smoke import NoPlan, full_steps
import labkit as lk
from labkit.estimate import full_step

def plan(notebook):
    try:
        steps = full_steps(notebook)
    except NoPlan as e:
        return dict(error=str(e))
    except BaseException:
        return dict(error="its parameters cell raised at LABKIT_SIZE=full:\n" + traceback.format_exc(limit=-3))
    out = {}
    for name, kw in steps.items():
        try:
            step = full_step(kw)                       # the entry read as gpu-smoke reads it
            extra = sum(step["beside"].values())
            if step["bytes"] is not None:
                out[str(name)] = dict(bytes=step["bytes"] + extra, how="given")
            else:
                out[str(name)] = dict(bytes=int(lk.estimate(**{**step["estimate"], "device": "cuda"}).total) + extra,
                                      how="estimated")
            if step["beside"]:
                out[str(name)]["how"] += " + " + ", ".join(step["beside"])
        except Exception as e:
            out[str(name)] = dict(error=f"{type(e).__name__}: {e}")
    return dict(steps=out)

for i, notebook in enumerate(sys.argv[1:]):
    print(f"FULL_PLAN {i} " + json.dumps(plan(notebook)), flush=True)
"""


def plans_of(notebooks):
    """Each notebook's full-size steps, as one child process reports them (or {"error": why} for a notebook)."""
    env = {**os.environ, "LABKIT_SIZE": "full", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MPLBACKEND": "Agg", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    timeout = 60 + 60 * len(notebooks)
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, *map(str, notebooks)], cwd=ROOT / "notebooks",
                             env=env, capture_output=True, text=True, timeout=timeout)
        stdout, died = run.stdout, f"the child process died (exit {run.returncode}):\n{run.stderr[-3000:]}"
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        died = f"the parameters cells and estimates took over {timeout} s in all (they must be cheap: configs only)"
    found = {}
    for line in stdout.splitlines():
        if line.startswith("FULL_PLAN "):
            i, result = line[len("FULL_PLAN "):].split(" ", 1)
            found[int(i)] = json.loads(result)
    return [found.get(i, dict(error=died)) for i in range(len(notebooks))]


def problems(notebook, result):
    """Every way the notebook's full size misses the workshop card, one message each (empty: it fits)."""
    name = pathlib.Path(notebook).name
    if "error" in result:
        return [f"{name}: {result['error']}"]
    limit = LIMIT
    out = []
    for step, got in result["steps"].items():
        if "error" in got:
            out.append(f"{name}: step {step!r} could not be estimated: {got['error']}")
        elif got["bytes"] > limit:
            out.append(f"{name}: step {step!r} needs {got['bytes'] / GiB:.1f} GiB ({got['how']}), over the "
                       f"{limit / GiB:.1f} GiB limit ({CARD / GiB:.0f} GiB with HEADROOM {HEADROOM:g} left free)")
    return out


class _Plans(dict):
    def __repr__(self):                # pytest prints a test's arguments: the notebook's name says enough
        return f"<plans of {len(self)} notebooks>"


@pytest.fixture(scope="module")
def plans():
    """Every notebook's plan, computed once, in one process."""
    return _Plans(zip(NOTEBOOKS, plans_of(NOTEBOOKS)))


def test_there_are_notebooks_to_check():
    assert len(NOTEBOOKS) >= 13, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_full_size_step_fits_a_24_gib_card(notebook, plans):
    found = problems(notebook, plans[notebook])
    assert not found, "\n".join(found)


# The checker itself, on toy notebooks: it must catch a step over budget and a notebook without a plan.

TOYS = {   # name: (the parameters cell, tagged `parameters`)
    "over budget": ("import labkit as lk\nSIZE = lk.size()\nFULL_STEPS = {\n"
                    "    'fits': dict(bytes='20 GiB'),\n"
                    "    'naive attention': dict(bytes=23 * 2**30),\n"
                    "    'training step': dict(config='llama-2-7b', batch=1, seq=512, dtype='fp32', optimizer='adamw'),\n"
                    "    'small step': dict(config='gpt2-124m', batch=1, seq=128, dtype='bf16', optimizer='adamw'),\n"
                    "}\nassert SIZE == 'full'\n", True),
    "no plan": ("BATCH = 4\n", True),
    "untagged": ("FULL_STEPS = {'x': dict(bytes=1)}\n", False),
    "own headroom": ("FULL_STEPS = {'x': dict(bytes=1, batch=2), 'y': dict(config='gpt2-124m', batchh=2)}\n"
                     "HEADROOM = 0.2\n", True),
    "bad entries": ("FULL_STEPS = {'x': dict(bytes=1, batch=2), 'y': dict(config='gpt2-124m', batchh=2)}\n", True),
    "raises": ("raise RuntimeError('boom')\n", True),
    "beside": ("FULL_STEPS = {'step': dict(bytes='15 GiB', beside={'a second model': '4 GiB', "
               "'its gradients': 4 * 2**30}), 'small': dict(bytes='1 GiB', beside={})}\n", True),
}


def _toy(folder, source, tagged=True):
    import nbformat
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(source)
    if tagged:
        cell.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# toy"), cell, nbformat.v4.new_code_cell("print('later')")]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "99_toy.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def toys(tmp_path_factory):
    """What the checker finds in each toy notebook of TOYS (one child process for all of them)."""
    root = tmp_path_factory.mktemp("toys")
    paths = [_toy(root / str(i), source, tagged) for i, (source, tagged) in enumerate(TOYS.values())]
    return {name: problems("99_toy.ipynb", result) for name, result in zip(TOYS, plans_of(paths))}


def test_a_step_over_budget_is_named_with_its_gib_and_the_limit(toys):
    """The 7B fp32 AdamW step is about 4 x 4 x 6.7e9 bytes = 100 GiB of states alone: far over 21.6 GiB."""
    found = toys["over budget"]
    assert len(found) == 2, found
    assert found[0] == ("99_toy.ipynb: step 'naive attention' needs 23.0 GiB (given), over the 21.6 GiB limit "
                        "(24 GiB with HEADROOM 0.1 left free)")
    assert found[1].startswith("99_toy.ipynb: step 'training step' needs ") and "(estimated)" in found[1]
    assert float(found[1].split(" needs ")[1].split(" GiB")[0]) > 100


def test_a_notebook_without_a_plan_fails_with_a_clear_message(toys):
    assert toys["no plan"] == ["99_toy.ipynb: its parameters cell does not define FULL_STEPS (contract 1: FULL_STEPS = "
                               "{step: lk.estimate keywords or dict(bytes=...)})"]
    assert toys["untagged"] == ["99_toy.ipynb: its first code cell is not tagged `parameters`"]


def test_bad_entries_and_a_raising_cell_are_reported_not_skipped(toys):
    assert toys["own headroom"] == ["99_toy.ipynb: its parameters cell sets HEADROOM = 0.2: the headroom is labkit's "
                                    "(lk.HEADROOM = 0.1), the same for every notebook"]
    found = toys["bad entries"]
    assert len(found) == 2 and "an entry with bytes holds nothing else" in found[0]
    assert "'y' could not be estimated: TypeError" in found[1] and "batchh" in found[1]
    found = toys["raises"]
    assert len(found) == 1 and "raised at LABKIT_SIZE=full" in found[0] and "RuntimeError: boom" in found[0]


def test_what_stays_alive_beside_a_step_counts_against_the_card(toys):
    assert toys["beside"] == ["99_toy.ipynb: step 'step' needs 23.0 GiB (given + a second model, its gradients), over "
                              "the 21.6 GiB limit (24 GiB with HEADROOM 0.1 left free)"]


# ---- what each cell keeps alive, measured at tiny size ------------------------------------------------
CELLS_CHECKED = ("13",)         # notebooks whose FULL_STEPS count what stays alive beside each step
CELL_SLACK = (0.10, 2 * 2**20)  # a cell may pass the largest declared step by 10% (the formula's error at tiny
                                # size, tests/test_estimate_families.py holds it to 5%) and 2 MiB (the data batch,
                                # the tokenizer: what does not scale with the model)

_COUNTER = r'''
import gc, json, weakref
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    """Real tensor storages alive during one cell: those before it (found by gc), then each one its ops make,
    until it dies (a weak reference's callback). Fake and meta tensors hold no memory and are not counted.
    `peak`: the most alive at once. `at_forward`: the most alive as a model's outermost forward begins (outside
    backward): what a step finds already there, its weights and optimizer state and whatever else is kept."""

    def start(self):
        import warnings
        self.refs, self.live, self.depth, self.at_forward = {}, 0, 0, 0
        with warnings.catch_warnings():              # isinstance() wakes deprecated module attributes
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    self.see(obj)
        self.peak = self.live
        self.hooks = [register_module_forward_pre_hook(self.pre), register_module_forward_hook(self.post)]

    def stop(self):
        for h in self.hooks:
            h.remove()

    def pre(self, module, args):
        if self.depth == 0 and torch._C._current_graph_task_id() == -1:    # not a recomputation in backward
            self.at_forward = max(self.at_forward, self.live)
        self.depth += 1

    def post(self, module, args, out):
        self.depth = max(self.depth - 1, 0)

    def see(self, t):
        if isinstance(t, FakeTensor) or t.device.type == "meta" or t.layout != torch.strided:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if id(st) not in self.refs:
            n = st.nbytes()
            self.refs[id(st)] = weakref.ref(st, lambda _, k=id(st), n=n: self.free(k, n))
            self.live += n
            self.peak = max(self.peak, self.live)

    def free(self, key, n):
        if self.refs.pop(key, None) is not None:
            self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.see(t)
        return out


_cells, _counter = [], _LiveBytes()


def _pre(info):
    _counter.start()
    _counter.__enter__()


def _post(result):
    _counter.__exit__(None, None, None)
    _counter.stop()
    _cells.append((_counter.peak, _counter.at_forward))


get_ipython().events.register("pre_run_cell", _pre)
get_ipython().events.register("post_run_cell", _post)
'''

_DECLARED = r'''
import json as _json
import labkit as _lk
from labkit.estimate import full_step as _full_step
_declared = {}
for _name, _kw in FULL_STEPS.items():
    _step = _full_step(_kw)
    _extra = sum(_step["beside"].values())
    if _step["bytes"] is not None:
        _declared[_name] = [_step["bytes"] + _extra] * 2
    else:
        _e = _lk.estimate(**{**_step["estimate"], "device": "cpu"})
        _states = sum(_e.peak_parts[c] for c in ("parameters", "gradients", "optimizer", "kv_cache"))
        _declared[_name] = [_e.total + _extra, _states + _extra]
'''


def cell_peaks(notebook, timeout=600):
    """([peak, alive as a forward begins] of each code cell at tiny size, {step: [declared peak, declared
    weights, gradients and optimizer state + beside] at tiny size}, the code cells)."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    for c in code:
        c.outputs, c.execution_count = [], None
    out = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"cell_peaks_{os.getpid()}.json"
    first = code[0]
    nb.cells = [nbformat.v4.new_code_cell(_COUNTER)] + nb.cells
    nb.cells.insert(nb.cells.index(first) + 1, nbformat.v4.new_code_cell(_DECLARED))
    nb.cells.append(nbformat.v4.new_code_cell(
        f"_json.dump(dict(cells=_cells, declared=_declared), open({str(out)!r}, 'w'))"))
    env = {"LABKIT_SIZE": "tiny", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,   # nbval runs the asserts
                       resources={"metadata": {"path": str(pathlib.Path(notebook).parent)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    found = json.loads(out.read_text())
    out.unlink()
    peaks = found["cells"]                        # from the parameters cell on (the counter's own cell is not seen)
    peaks = peaks[:1] + peaks[2:]                 # less the declared sizes' cell, after the parameters cell
    return peaks[:len(code)], found["declared"], code


def too_much(peaks, declared, code, name="notebook"):
    """Every cell that holds more than FULL_STEPS declares (with CELL_SLACK), one message each: at its peak, more
    than the largest declared step; or, as a forward begins, more than the largest declared step's weights,
    gradients and optimizer state (and what its `beside` names). The second is the one that scales: at tiny
    size activations outweigh the model, at full size the model outweighs them, so a second model kept beside
    a step hides under the first limit at tiny size and not under the second."""
    out = []
    for what, k in (("at its peak", 0), ("as a forward begins", 1)):
        biggest = max(declared, key=lambda n: declared[n][k])
        limit = declared[biggest][k] * (1 + CELL_SLACK[0]) + CELL_SLACK[1]
        label = "its largest step" if k == 0 else "the weights, gradients and optimizer state (+ beside) of"
        out += [f"{name}: code cell {i} ({cell.source.splitlines()[0][:60]!r}) holds {got[k] / 2**20:.1f} MiB {what} "
                f"at tiny size; FULL_STEPS declares {declared[biggest][k] / 2**20:.1f} MiB, {label} {biggest!r}: "
                f"it keeps more alive than it declares"
                for i, (got, cell) in enumerate(zip(peaks, code)) if got[k] > limit]
    return out


@pytest.mark.parametrize("number", CELLS_CHECKED)
def test_no_cell_keeps_more_alive_than_its_full_steps_declare(number):
    notebook = next(p for p in NOTEBOOKS if p.name.startswith(number))
    peaks, declared, code = cell_peaks(notebook)
    assert len(peaks) == len(code)
    found = too_much(peaks, declared, code, notebook.name)
    assert not found, "\n".join(found)


def test_the_cell_check_finds_a_second_model_kept_beside_a_step(tmp_path):
    """A toy notebook whose second cell keeps a plain model, its gradients, a clone of them, AdamW's state and a
    second model alive together, as 13's correctness cell once did: caught; the same work with the first model
    deleted before the second is built: not caught."""
    import nbformat
    params = ("import torch\nimport labkit as lk\nCONFIG = lk.models.config('llama-2-7b', 'tiny')\n"
              "FULL_STEPS = {'plain step': dict(config=CONFIG, batch=2, seq=64, dtype='fp32', optimizer='adamw')}\n")
    step = ("def step(m):\n    ids = torch.zeros(2, 64, dtype=torch.long)\n    opt = torch.optim.AdamW(m.parameters())\n"
            "    m(input_ids=ids, labels=ids, use_cache=False).loss.backward()\n    opt.step()\n    return opt\n")
    kept = step + ("plain = lk.models.build('llama-2-7b', 'tiny')\nadamw = step(plain)\n"
                   "grads = [p.grad.clone() for p in plain.parameters()]\n"
                   "second = lk.models.build('llama-2-7b', 'tiny')\nstep(second)\n")
    freed = step + ("plain = lk.models.build('llama-2-7b', 'tiny')\nadamw = step(plain)\ndel plain, adamw\n"
                    "second = lk.models.build('llama-2-7b', 'tiny')\nstep(second)\ndel second\n")
    results = []
    for body in (kept, freed):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(params), nbformat.v4.new_code_cell(body)]
        nb.cells[0].metadata["tags"] = ["parameters"]
        path = tmp_path / "99_toy.ipynb"
        nbformat.write(nb, path)
        results.append(too_much(*cell_peaks(path, timeout=300), name="99_toy.ipynb"))
    assert results[0] and all("code cell 1 ('def step(m):')" in m for m in results[0]), results[0]
    assert any("as a forward begins" in m for m in results[0]), results[0]
    assert results[1] == [], results[1]


# ---- the helper gpu-smoke shares ----------------------------------------------------------------------
def test_full_step_reads_an_entry_as_estimate_and_gpu_smoke_need_it():
    """labkit.estimate.full_step: lk.estimate's keywords, what stays beside, the levers a plain loop does not run,
    and the levers labkit.plan.verify.measure runs on a GPU; bad entries named before any work."""
    from labkit.estimate import full_step
    import labkit as lk
    cfg = lk.models.config("llama-2-7b", "tiny")
    step = full_step(dict(config=cfg, batch=4, seq=256, dtype="bf16", optimizer="paged-adamw-8bit", recompute=True,
                          fused_step=True, chunked_ce=True, attention="sdpa", zero=0, offload=None, accumulate=False,
                          beside={"the token ids": 8192, "a copy": "1 MiB"}))
    assert step["beside"] == {"the token ids": 8192, "a copy": 2**20} and step["bytes"] is None
    assert step["levers"] == {"fused_step": True, "chunked_ce": True}
    assert step["verify"] == dict(dtype="bf16", optimizer="paged-adamw-8bit", fused_step=True, recompute=True,
                                  chunked_ce=True, attention="sdpa", activation_offload=False, zero=0, offload=None,
                                  micro_batch=4, grad_accum=1)
    assert lk.estimate(**step["estimate"]).total > 0
    plain = full_step(dict(config=cfg, batch=2, seq=64, dtype="fp16", optimizer="sgd"))
    assert plain["levers"] == {} and plain["verify"] is None           # fp16 and SGD: not verify's levers
    assert full_step(dict(bytes="2 GiB"))["bytes"] == 2 * 2**30
    for bad, error in ((dict(config=cfg, batchh=2), "batchh"), (dict(bytes=1, batch=2), "nothing else"),
                       (dict(config=cfg, beside=[1]), "beside must be a dict"), (3, "must be a dict"),
                       (dict(batch=2), "config is missing"), (dict(config=cfg, beside={"x": "lots"}), "beside")):
        with pytest.raises((TypeError, ValueError), match=error):
            full_step(bad)
