"""What a notebook may assert, and what it may print: checks on the notebooks' source.

At tiny size a notebook asserts counted work (bytes, FLOPs, events), never wall-clock time: CI and
learners run on different, shared CPUs. Time may be asserted only under a GPU guard.
"""
import ast
import json
import pathlib
import re

import importlib.util

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
TIME_WORDS = re.compile(r"\b(time|times|time_s|seconds|secs?|speedup|speed_up|overhead|latency|ms|elapsed)\b"
                        r"|_s\b|perf_counter|\.time\(", re.IGNORECASE)
GPU_GUARD = re.compile(r"cuda|gpu", re.IGNORECASE)
# Seconds a model predicts, not a clock's reading: lk.plan's cost model (Plan.step_time_s) is arithmetic.
PREDICTED = re.compile(r"\.step_time_s\b")


def timed_asserts(source):
    """Asserts in `source` that mention time and are not nested in an `if` about CUDA/GPU."""
    tree = ast.parse(source)
    found = []

    def visit(node, guarded):
        if isinstance(node, ast.Assert):      # what is asserted, not the message's words
            if TIME_WORDS.search(PREDICTED.sub(".predicted", ast.unparse(node.test))) and not guarded:
                found.append((ast.get_source_segment(source, node) or "").splitlines()[0])
        for child in ast.iter_child_nodes(node):
            is_guard = isinstance(node, ast.If) and child in node.body and GPU_GUARD.search(ast.unparse(node.test))
            visit(child, guarded or bool(is_guard))

    visit(tree, False)
    return found


def code_cells(path):
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            # IPython magics and shell escapes are not Python
            yield i, "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_wall_clock_asserts_outside_a_gpu_branch(path):
    bad = [f"cell {i}: {a}" for i, src in code_cells(path) for a in timed_asserts(src)]
    assert not bad, f"{path.name} asserts wall-clock time at tiny size (count work instead):\n" + "\n".join(bad)


def test_the_time_check_finds_what_it_should():
    assert timed_asserts("assert overhead > 0.05")
    assert timed_asserts("r = 1\nassert r.time_s < 2")
    assert not timed_asserts("if torch.cuda.is_available():\n    assert overhead > 0.2")
    assert not timed_asserts("if lk.has('cuda'):\n    x = 1\n    assert r.time_s < 2")
    assert timed_asserts("if lk.has('cuda'):\n    pass\nelse:\n    assert r.time_s < 2")
    assert not timed_asserts("assert flops_recomputed == 2 * flops_forward")
    assert not timed_asserts("assert n == 2, 'two times the bytes'")
    assert not timed_asserts("assert best.step_time_s < other.step_time_s")     # the planner's arithmetic
    assert timed_asserts("assert best.step_time_s < r.time_s")


def test_stderr_needs_the_tag():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    unexpected_stderr, STDERR_TAG = hooks.unexpected_stderr, hooks.STDERR_TAG
    err = [{"output_type": "stream", "name": "stderr", "text": "UserWarning: noise\n"},
           {"output_type": "stream", "name": "stdout", "text": "fine\n"}]
    assert unexpected_stderr(err, []) == "UserWarning: noise\n"
    assert unexpected_stderr(err, [STDERR_TAG]) == ""
    assert unexpected_stderr(err[1:], []) == ""


def _cell_defining(name, text):
    """The source of the one code cell of notebook `name` that contains `text`."""
    found = [src for _, src in code_cells(ROOT / "notebooks" / name) if text in src]
    assert len(found) == 1, f"{name}: {len(found)} code cells contain {text!r}"
    return found[0]


def test_selective_checkpointing_saves_every_fused_attention_kernel_sdpa_can_pick():
    """Notebook 03's policy keeps attention's output on every backend: SDPA may run cuDNN's kernel (when it
    is preferred, e.g. with sdpa_kernel), and a policy without that op recomputes attention there. Every fused forward op of this torch
    counts (the math fallback, `_scaled_dot_product_attention_math*`, is bmm and softmax: no fused op)."""
    import functools
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    ns = dict(torch=torch, partial=functools.partial, CheckpointPolicy=CheckpointPolicy, LAYERS=16,
              create_selective_checkpoint_contexts=create_selective_checkpoint_contexts,
              checkpoint_every=lambda model, k, context_fn=None: model)
    exec(_cell_defining("03_activation_checkpointing.ipynb", "SAVE = {"), ns)
    fused = sorted(n for n in torch._C._dispatch_get_all_op_names()       # "aten::name" or "aten::name.overload"
                   if n.startswith("aten::_scaled_dot_product_") and "." not in n
                   and "backward" not in n and "attention_math" not in n)
    assert "aten::_scaled_dot_product_cudnn_attention" in fused
    missing = [n for n in fused if getattr(torch.ops.aten, n.split("::")[1]).default not in ns["SAVE"]]
    assert not missing, f"notebook 03's selective policy recomputes attention under {missing}"


# ---- notebooks 03, 04, 05: their exercise checks against hostile answers ----------------------------------
def _nb345_check(name, answer, check):
    """Runs notebook `name`'s parameters cell, then `answer` (the learner's cell), then the check cell containing
    `check`, in one fresh namespace; returns what they printed."""
    import contextlib
    import io
    ns, out = {}, io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(next(src for _, src in code_cells(ROOT / "notebooks" / name)), ns)
        ns.setdefault("cfg", ns.get("CONFIG"))
        exec(answer, ns)
        exec(_cell_defining(name, check), ns)
    return out.getvalue()


def test_notebook_03s_recompute_check_refuses_torch_checkpointing_by_any_route():
    """Exercise 1 (checkpointing from scratch) answered with torch.utils.checkpoint imported under an alias,
    its reentrant CheckpointFunction held in a default argument, or reached through sys.modules: each refused
    (the whole module is forbidden); the answer key passes."""
    nb, check = "03_activation_checkpointing.ipynb", 'with lk.exercise(1, "complete Recompute above"'
    assert "Exercise 1: passed" in _nb345_check(nb, _nb3_solution(nb, "class Recompute("), check)
    bypasses = [
        "from torch.utils.checkpoint import checkpoint as cp\nclass Recompute:\n    @staticmethod\n"
        "    def apply(fn, x):\n        return cp(fn, x, use_reentrant=False)",
        "import torch.utils.checkpoint\nclass Recompute:\n    @staticmethod\n"
        "    def apply(fn, x, _f=torch.utils.checkpoint.CheckpointFunction):\n        return _f.apply(fn, True, x)",
        "import sys\nclass Recompute:\n    @staticmethod\n    def apply(fn, x):\n"
        "        return sys.modules['torch.utils.checkpoint'].checkpoint(fn, x, use_reentrant=False)",
    ]
    for answer in bypasses:
        with pytest.raises(AssertionError, match="your answer calls torch.utils.checkpoint"):
            _nb345_check(nb, answer, check)


def test_notebook_05s_allocator_checks_refuse_labkit_alloc_and_hide_their_reference():
    """Exercises 1 and 2 (best fit, rounding) answered through labkit.alloc (a default argument, sys.modules,
    an aliased import): refused. An answer that looks the expected values up in the notebook's globals (the
    reference lists used to be globals, and that bypass passed) finds nothing and fails."""
    nb = "05_caching_allocator.ipynb"
    first, second = 'with lk.exercise(1, "write my_best_fit() above"', 'with lk.exercise(2, "write my_round_size() above"'
    assert "Exercise 1: passed" in _nb345_check(nb, _nb3_solution(nb, "def my_best_fit("), first)
    assert "Exercise 2: passed" in _nb345_check(nb, _nb3_solution(nb, "def my_round_size("), second)
    via_alloc = [
        (first, "def my_best_fit(free_blocks, size, max_split=None, _A=Allocator):\n    _A()\n    return None"),
        (first, "import sys\ndef my_best_fit(free_blocks, size, max_split=None):\n"
                "    return sys.modules['labkit.alloc'].round_size(size, None)"),
        (second, "from labkit.alloc import round_size as rs, parse_conf as pc\n"
                 "def my_round_size(size, divisions):\n    return rs(size, pc(''))"),
    ]
    for check, answer in via_alloc:
        with pytest.raises(AssertionError, match="your answer calls labkit.alloc"):
            _nb345_check(nb, answer, check)
    lookups = [
        (first, "def my_best_fit(free_blocks, size, max_split=None):\n    g = globals()\n"
                "    return next((t[3] for t in g.get('trials', ()) if t[:3] == (free_blocks, size, max_split)), None)"),
        (second, "def my_round_size(size, divisions):\n    g = globals()\n"
                 "    return g['expected'][g['tests'].index((size, divisions))]"),
    ]
    for check, answer in lookups:
        with pytest.raises((AssertionError, KeyError)):
            _nb345_check(nb, answer, check)


# ---- notebooks 00, 01, 02 (nb1) --------------------------------------------------------------------------
NB1 = ["00_start_here.ipynb", "01_memory_anatomy.ipynb", "02_mixed_precision.ipynb"]


def _nb1_predictions(name):
    """{PREDICT_ name: its default, as source} in notebook `name`."""
    found = {}
    for _, src in code_cells(ROOT / "notebooks" / name):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith("PREDICT_"):
                        found[target.id] = ast.unparse(node.value)
    return found


@pytest.mark.parametrize("name", NB1)
def test_predictions_of_notebooks_00_to_02_start_as_not_predicted(name):
    """A PREDICT_ variable defaults to None: a number there would answer the question for the learner
    (00's used to be fixed in MiB where full size measures GiB, 02's at half the fp32 peak)."""
    found = _nb1_predictions(name)
    assert found, f"{name} asks for no prediction"
    assert all(v == "None" for v in found.values()), f"{name}: predictions pre-filled: {found}"


def _nb1_check(name, text, ns, answer):
    """Runs the check cell of notebook `name` containing `text`, after `answer` (the learner's definitions)
    and the helper cell it calls, where it has one (02's scaler_trace)."""
    exec(answer, ns)
    src = _cell_defining(name, text)
    if "scaler_trace(" in src and "def scaler_trace(" not in src:
        exec(_cell_defining(name, "def scaler_trace("), ns)
    exec(src, ns)


def _nb1_key(name, text):
    """The answer key: the code cell of `name` containing `text`, solution markers dropped."""
    return _cell_defining(name, text).replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", "")


def _nb1_refused(name, text, ns, answer, calls="labkit"):
    with pytest.raises(AssertionError, match=f"your answer calls {calls}"):
        _nb1_check(name, text, ns, answer)


def test_notebook_00s_storage_check_refuses_labkits_own_counting():
    """Exercise 1 (distinct storage bytes) answered with labkit.estimate's own storage counter, reached
    through sys.modules, or with lk.track held in a default argument: both refused; the answer key passes."""
    import torch
    import labkit as lk
    nb, check = "00_start_here.ipynb", 'with lk.exercise(1, "complete storage_bytes() above"'
    base = dict(torch=torch, lk=lk)
    _nb1_check(nb, check, dict(base), _nb1_key(nb, "def storage_bytes("))
    private = ("def storage_bytes(tensors):\n    import sys\n"
               "    return sys.modules['labkit.estimate.step'].storage_bytes(tensors)")
    tracked = ("def storage_bytes(tensors, _track=lk.track):\n    with _track(tensors) as m:\n        pass\n"
               "    return m.live")
    for answer in (private, tracked):
        _nb1_refused(nb, check, dict(base), answer)


def _nb01_saved_bytes_namespace():
    """Notebook 01's parameters cell and its per-family cell (lk.track's one-layer reference), run at tiny size."""
    import contextlib
    import io
    nb, ns = "01_memory_anatomy.ipynb", {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(next(src for _, src in code_cells(ROOT / "notebooks" / nb)), ns)
        exec("import importlib\nfrom labkit.estimate import activation_bytes_per_token", ns)
        exec(_cell_defining(nb, "one_layer = {}"), ns)
    return ns


def test_notebook_01s_saved_bytes_check_refuses_labkits_counters_by_any_route():
    """Exercise 2 (what autograd keeps) answered with lk.track held in a default argument, or with labkit's
    SavedBytesByDevice reached through sys.modules: both refused; the answer key passes; counting every save
    without merging shared storages fails on the bytes."""
    nb, check = "01_memory_anatomy.ipynb", 'with lk.exercise(2, "complete saved_bytes() above"'
    _nb1_check(nb, check, _nb01_saved_bytes_namespace(), _nb1_key(nb, "def saved_bytes("))
    held = ("def saved_bytes(model, ids, _track=lk.track):\n    with _track(model) as m:\n"
            "        out = model(input_ids=ids, use_cache=False)\n    return m.at('forward end')['activations']")
    module = ("def saved_bytes(model, ids):\n    import sys\n"
              "    with sys.modules['labkit.copies'].SavedBytesByDevice() as s:\n"
              "        out = model(input_ids=ids, use_cache=False)\n"
              "    return sum(s.bytes.values()) - sum(p.nbytes for p in model.parameters())")
    for answer in (held, module):
        _nb1_refused(nb, check, _nb01_saved_bytes_namespace(), answer)
    every_save = ("def saved_bytes(model, ids):\n    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}\n"
                  "    total = []\n    def pack(t):\n        if t.untyped_storage().data_ptr() not in weights:\n"
                  "            total.append(t.untyped_storage().nbytes())\n        return t\n"
                  "    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):\n"
                  "        out = model(input_ids=ids, use_cache=False)\n    return sum(total)")
    with pytest.raises(AssertionError, match="each once"):
        _nb1_check(nb, check, _nb01_saved_bytes_namespace(), every_save)


def test_notebook_02s_scaler_check_refuses_pytorchs_own_scaling():
    """Exercise 1 (a dynamic loss scaler) answered with GradScaler's two kernels called directly
    (torch._amp_foreach_non_finite_check_and_unscale_, torch._amp_update_scale_: the bypass of issue 27),
    the same kernels through torch.ops.aten, or a GradScaler subclass: all refused; the answer key passes."""
    import torch
    import labkit as lk
    nb, check = "02_mixed_precision.ipynb", 'with lk.exercise(1, "complete LossScaler above"'
    base = dict(torch=torch, lk=lk, DEVICE=torch.device("cpu"))
    _nb1_check(nb, check, dict(base), _nb1_key(nb, "class LossScaler:"))
    kernels = '''
class LossScaler:
    def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
        self._scale, self._tracker = torch.full((), scale), torch.zeros((), dtype=torch.int32)
        self.growth, self.backoff, self.interval = growth, backoff, interval
    @property
    def scale(self):
        return self._scale.item()
    def scale_loss(self, loss):
        return loss * self._scale
    def step(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self._scale.reciprocal())
        if not found.item():
            optimizer.step()
        torch._amp_update_scale_(self._scale, self._tracker, found, self.growth, self.backoff, self.interval)
'''
    subclass = '''
class LossScaler(torch.amp.GradScaler):
    def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
        super().__init__("cpu", init_scale=scale, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    scale_loss = torch.amp.GradScaler.scale
'''
    aten = kernels.replace("torch._amp_", "torch.ops.aten._amp_")      # the same kernels through torch.ops
    for answer in (kernels, aten, subclass):
        _nb1_refused(nb, check, dict(base), answer, calls="torch")


# notebook 02's exercise 2 (fp32 master weights): tests/test_nb02_04_claims.py


def test_notebook_00s_storage_check_refuses_pytorchs_tracker_and_fails_a_copied_reference():
    """Exercise 1 answered with PyTorch's MemTracker (a storage counter too) is refused; an answer that returns
    the first list's reference (a global of the check) fails on the second list."""
    import torch
    import labkit as lk
    nb, check = "00_start_here.ipynb", 'with lk.exercise(1, "complete storage_bytes() above"'
    theirs = ("def storage_bytes(tensors):\n    from torch.distributed._tools.mem_tracker import MemTracker\n"
              "    tracker = MemTracker()\n    tracker.track_external(*tensors)\n    with tracker:\n        pass\n"
              "    return tracker.get_tracker_snapshot('current')[torch.device('cpu')]['Total']")
    _nb1_refused(nb, check, dict(torch=torch, lk=lk), theirs, calls="torch.distributed._tools.mem_tracker")
    with pytest.raises(AssertionError, match="must equal the live bytes"):
        _nb1_check(nb, check, dict(torch=torch, lk=lk), "def storage_bytes(tensors):\n    return cases[0][1]")


def test_notebook_00s_optimizer_check_fails_an_answer_that_measures_nothing():
    """Exercise 2's answers are numbers a learner can guess (8 for SGD): the check asks for two optimizers and
    wants each step to have run, so a typed-in 8 (even after an untracked step), or the check's own reference,
    fails; the answer key passes."""
    import importlib
    import torch
    import labkit as lk
    nb, check = "00_start_here.ipynb", 'with lk.exercise(2, "complete states_per_param() above"'
    model = lk.models.build("llama-2-7b", "tiny", dtype=torch.float32)
    base = dict(torch=torch, lk=lk, importlib=importlib, model=model, batches=lk.data.batches(2, 32),
                BATCH=2, SEQ=32, per_param=16.0)
    _nb1_check(nb, check, dict(base), _nb1_key(nb, "def states_per_param("))
    untracked = ("def states_per_param(make_optimizer):\n    o = make_optimizer(model.parameters())\n"
                 "    ids = next(batches)\n    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()\n"
                 "    o.step()\n    o.zero_grad(set_to_none=True)\n    return 8.0")
    with pytest.raises(AssertionError, match="SGD with momentum: one step"):
        _nb1_check(nb, check, dict(base), untracked)
    for answer in ("def states_per_param(make_optimizer):\n    return 8.0",
                   "def states_per_param(make_optimizer):\n    return want"):
        with pytest.raises(AssertionError, match="weights did not move"):
            _nb1_check(nb, check, dict(base), answer)


def test_notebook_00s_allocator_cell_accepts_a_plausible_allocator_and_refuses_impossible_ones(monkeypatch):
    """The CUDA branch of 00's allocator cell, run on a CPU: lk.track stands in for the allocator's books
    (mem.cuda) with chosen figures. Growth equal to the tracker's plus 512-byte rounding and some workspace
    passes; an allocator that grew less than the tracker counted, or far more than rounding and workspace
    allow, fails the cell's assert."""
    import types
    import torch
    import labkit as lk
    src = _cell_defining("00_start_here.ipynb", "step_mem.cuda is None")
    model = lk.models.build("llama-2-7b", "tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    fixed = next(lk.data.batches(2, 32))

    def fixed_step():
        model(input_ids=fixed, labels=fixed, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    fixed_step()
    untracked = 4 * 2**20                                   # e.g. cuBLAS's workspace, made before the block

    def run(extra):
        """The cell, with the allocator's growth = the tracker's + `extra` bytes."""
        class Books:
            def __init__(self, *objs, device=None):
                self.inner = lk.track(*objs)
            def __enter__(self):
                return self.inner.__enter__()
            def __exit__(self, *exc):
                out = self.inner.__exit__(*exc)
                r = self.inner
                start = r.start + untracked
                r.cuda = dict(allocated_start=start, peak_allocated=start + r.peak - r.start + extra,
                              peak_reserved=start + r.peak - r.start + extra + 2**21)
                return out
        shim = types.SimpleNamespace(track=Books, fmt_bytes=lk.fmt_bytes, MiB=lk.MiB)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2**33, 2**34), raising=False)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 2**32, raising=False)
        ns = dict(torch=torch, lk=shim, model=model, opt=opt, fixed_step=fixed_step, DEVICE=torch.device("cuda"),
                  BATCH=2, SEQ=32, CONFIG=model.config)
        exec(src, ns)
        return ns

    ns = run(511 * 40)                                       # rounding of 40 blocks: within the bound
    assert ns["grown"] - ns["counted"] == 511 * 40
    with pytest.raises(AssertionError, match="at least its size"):
        run(-1)                                              # the allocator below the tracker: impossible
    with pytest.raises(AssertionError):
        run(2**31)                                           # 2 GiB more: neither rounding nor workspace


def test_notebook_01s_allocator_books_accept_rounding_and_refuse_a_short_allocator():
    """01's allocator_books() (the CUDA branch beside the baseline table), run on a CPU with the allocator's
    figures chosen: the tracker's growth plus rounding passes; less than the tracker counted fails."""
    import torch
    import labkit as lk
    ns = dict(torch=torch, lk=lk, DEVICE=torch.device("cpu"), SIZE="tiny", LAYERS={}, BATCH=2, SEQ=32, rows=[])
    exec(_cell_defining("01_memory_anatomy.ipynb", "def allocator_books("), ns)
    model = lk.models.build("llama-2-7b", "tiny")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = next(lk.data.batches(2, 32))
    with lk.track(model, opt) as mem:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
    for extra, ok in ((0, True), (511 * 10, True), (-512, False)):
        start = mem.start + 2**20
        mem.cuda = dict(allocated_start=start, peak_allocated=start + mem.peak - mem.start + extra, peak_reserved=2**40)
        if ok:
            ns["allocator_books"]("llama-2-7b", "fp32", "sgd", mem)
        else:
            with pytest.raises(AssertionError):
                ns["allocator_books"]("llama-2-7b", "fp32", "sgd", mem)


def test_notebook_02s_checks_refuse_fsdps_scaler_and_the_checks_own_measurement():
    """Exercise 1 answered with FSDP's ShardedGradScaler, whose CPU path re-implements the scale update in
    Python (no GradScaler method, no kernel), is refused (exercise 2: tests/test_nb02_04_claims.py)."""
    import importlib
    import torch
    import labkit as lk
    nb = "02_mixed_precision.ipynb"
    sharded = '''
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
class LossScaler:
    def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
        self.h = object.__new__(ShardedGradScaler)
        self.h._scale, self.h._growth_tracker = torch.full((), float(scale)), torch.zeros((), dtype=torch.int32)
        self.h._growth_factor, self.h._backoff_factor, self.h._growth_interval = growth, backoff, interval
    @property
    def scale(self):
        return self.h._scale.item()
    def scale_loss(self, loss):
        return loss * self.h._scale
    def step(self, optimizer):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for g in grads:
            g.div_(self.h._scale)
        found = torch.tensor(0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0)
        if not found.item():
            optimizer.step()
        self.h._amp_update_scale_cpu_(found)
'''
    base = dict(torch=torch, lk=lk, DEVICE=torch.device("cpu"))
    _nb1_refused(nb, 'with lk.exercise(1, "complete LossScaler above"', dict(base), sharded,
                 calls="torch.distributed.fsdp.sharded_grad_scaler")


# ---- notebooks 06, 07, 09, 10, 11 (nb3) --------------------------------------------------------------------
NB3 = ["06_quantization_qlora.ipynb", "07_kv_cache_paged_attention.ipynb", "09_tensor_and_pipeline_parallelism.ipynb",
       "10_zero_and_fsdp.ipynb", "11_compile_and_engines.ipynb"]


@pytest.mark.parametrize("name", NB3)
def test_predictions_of_notebooks_06_to_11_start_as_not_predicted(name):
    """A PREDICT_ variable defaults to None: a number there would answer the question for the learner."""
    found = {}
    for _, src in code_cells(ROOT / "notebooks" / name):
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.startswith("PREDICT_"):
                        found[target.id] = ast.unparse(node.value)
    assert found, f"{name} asks for no prediction"
    assert all(v == "None" for v in found.values()), f"{name}: predictions pre-filled: {found}"


def _nb3_solution(name, text):
    """The code cell of notebook `name` that contains `text`, its solution markers dropped (the answer key)."""
    return _cell_defining(name, text).replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", "")


def _nb3_check(name, text, ns, answer):
    """Runs the check cell of `name` containing `text` with `answer` (source defining the learner's function)."""
    exec(answer, ns)
    exec(_cell_defining(name, text), ns)


def _nb3_refused(name, text, ns, answer):
    with pytest.raises(AssertionError, match="calls labkit"):
        _nb3_check(name, text, ns, answer)


def test_notebook_06s_exercise_1_refuses_bitsandbytes_by_any_route():
    """Exercise 1 (NF4 packing) answered through bitsandbytes' torch op held in a default argument, through
    sys.modules, and through Params4bit (which quantizes in .to()): each refused; the answer key passes."""
    import sys
    import torch
    import torch.nn.functional as F
    import labkit as lk
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    nb = "06_quantization_qlora.ipynb"
    ns = dict(lk=lk, torch=torch, F=F, bnb=bnb, bnbf=bnbf, BLOCK=64)
    exec(_cell_defining(nb, "def blockwise("), ns)          # minilm, W, blockwise
    exec(_cell_defining(nb, "def nf4_codebook("), ns)       # NF4
    check = 'with lk.exercise(1, "complete nf4_quantize() above"'
    _nb3_check(nb, check, dict(ns), _nb3_solution(nb, "def nf4_quantize("))
    bypasses = [
        "def nf4_quantize(w, block=64, _op=torch.ops.bitsandbytes.quantize_4bit):\n"
        "    packed, absmax = _op(w, block, 'nf4', torch.uint8)\n    return packed.flatten(), absmax",
        "import sys\ndef nf4_quantize(w, block=64):\n"
        "    q, st = sys.modules['bitsandbytes.functional'].quantize_4bit(w, blocksize=block, quant_type='nf4',"
        " compress_statistics=False)\n    return q.flatten(), st.absmax",
        "def nf4_quantize(w, block=64):\n"
        "    p = bnb.nn.Params4bit(w, requires_grad=False, blocksize=block, quant_type='nf4',"
        " compress_statistics=False).to('cpu')\n    return p.data.flatten(), p.quant_state.absmax",
    ]
    for answer in bypasses:
        with pytest.raises(AssertionError, match="your answer calls (bitsandbytes|torch.ops)"):
            _nb3_check(nb, check, dict(ns), answer)


def test_notebook_07s_exercise_checks_refuse_the_library_by_any_route():
    """Exercise 1 with paged.block_hashes held in a default argument, through sys.modules and imported under
    another name, exercise 2 through can_allocate on a pool of its own: all refused. An answer that returns
    the check's references by name finds none (they are the check's locals). The answer key passes."""
    from collections import Counter
    import labkit as lk
    from labkit import paged
    from labkit.paged import BlockAllocator, BlockTables, NOW, LATER, NEVER
    nb, block = "07_kv_cache_paged_attention.ipynb", 16

    def fresh_tables(capacity, **options):
        return paged.serving_tables(BlockAllocator(capacity // block, block), **options)

    prompts = [list(range(i, i + 40 + i)) for i in range(20)]
    base = dict(lk=lk, paged=paged, BLOCK=block, shared_prompts=prompts, Counter=Counter, NOW=NOW, LATER=LATER,
                NEVER=NEVER, fresh_tables=fresh_tables)
    first, second = 'with lk.exercise(1, "write my_block_hashes() above"', 'with lk.exercise(2, "write admission() above"'
    _nb3_check(nb, first, dict(base), _nb3_solution(nb, "def my_block_hashes("))
    _nb3_refused(nb, first, dict(base), "def my_block_hashes(t, b, _lib=paged.block_hashes):\n    return _lib(t, b)")
    _nb3_check(nb, second, dict(base), _nb3_solution(nb, "def admission("))
    _nb3_refused(nb, second, dict(base), "def admission(free, total, need, watermark):\n"
                                     "    return fresh_tables(total * BLOCK).can_allocate(need * BLOCK)")
    _nb3_refused(nb, first, dict(base), "import sys\ndef my_block_hashes(t, b):\n"
                                    "    return sys.modules['labkit.paged'].block_hashes(t, b)")
    _nb3_refused(nb, first, dict(base), "from labkit.paged import block_hashes as h\n"
                                    "def my_block_hashes(t, b):\n    return h(t, b)")
    for answer in ("def my_block_hashes(t, b):\n    return references[shared_prompts.index(t)]",
                   "def admission(free, total, need, watermark):\n    return cases[0][4]"):
        with pytest.raises(NameError):            # the references are the check's locals, not globals
            _nb3_check(nb, first if "hashes" in answer else second, dict(base), answer)


def test_notebook_10s_exercise_checks_refuse_an_imported_library_function():
    """`from labkit.zero import shard` inside the answer, and labkit's model_states imported under another
    name: both refused; the answer key passes. The ranks' measurement is stood in for by the formula."""
    import torch
    import labkit as lk
    from labkit import zero
    from labkit.estimate import model_states
    nb, P, world = "10_zero_and_fsdp.ipynb", 10**6, 2

    def states(stage):
        return model_states(P, dp=world, zero=stage)

    base = dict(torch=torch, lk=lk, zero=zero, model_states=model_states, STAGES=zero.STAGES, P=P, WORLD=world,
                states=states)
    first, second = 'with lk.exercise(1, "write my_reduce_scatter', 'with lk.exercise(2, "write states_per_param'
    _nb3_check(nb, first, dict(base), _nb3_solution(nb, "def my_reduce_scatter("))
    _nb3_refused(nb, first, dict(base), "def my_reduce_scatter(grads, rank):\n    from labkit.zero import shard\n"
                                    "    return shard(sum(grads) / len(grads), rank, len(grads))")
    _nb3_check(nb, second, dict(base), _nb3_solution(nb, "def states_per_param("))
    _nb3_refused(nb, second, dict(base), "def states_per_param(stage, n):\n    from labkit.estimate import model_states as m\n"
                                     "    return sum(m(10**6 * n, dp=n, zero=stage).values()) / (10**6 * n)")


def test_notebook_10s_exercise_3_wants_the_gathered_weight_gone_after_forward():
    """ZeRO-3's pack/unpack: the answer key passes; a pack that keeps the tensor (the graph then holds the
    gathered weight until backward) fails, and so does one that calls labkit.zero's own `Zero3.pack`."""
    import torch
    import labkit as lk
    from labkit import zero
    nb = "10_zero_and_fsdp.ipynb"
    base = dict(torch=torch, lk=lk, zero=zero)
    exec(_cell_defining(nb, "def gather():"), base)
    check = 'with lk.exercise(3, "write pack() and unpack() above"'
    _nb3_check(nb, check, dict(base), _nb3_solution(nb, "def pack(t):"))
    with pytest.raises(AssertionError, match="still holds the gathered weight"):
        _nb3_check(nb, check, dict(base), "def pack(t):\n    return t\n\ndef unpack(saved):\n    return saved")
    _nb3_refused(nb, check, dict(base), "def pack(t):\n    engine = zero.Zero3.__new__(zero.Zero3)\n"
                                        "    engine._gathered = dict.fromkeys(gathered, 0)\n    return zero.Zero3.pack(engine, t)\n"
                                        "def unpack(saved):\n    return saved")


def test_notebook_09s_row_parallel_check_refuses_labkits_parallel_layers():
    """Exercise 1 answered with labkit.tensor_parallel's own RowParallelLinear, imported inside the answer:
    refused by name; the answer key passes."""
    import torch
    import torch.nn.functional as F
    import labkit as lk
    from labkit import tensor_parallel
    nb = "09_tensor_and_pipeline_parallelism.ipynb"
    layer = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=1).model.layers[0]
    base = dict(torch=torch, F=F, lk=lk, tensor_parallel=tensor_parallel, layer=layer,
                error=lambda a, b: ((a - b).norm() / b.norm()).item())
    check = 'with lk.exercise(1, "complete row_parallel() above"'
    _nb3_check(nb, check, dict(base), _nb3_solution(nb, "def row_parallel("))
    _nb3_refused(nb, check, dict(base), "def row_parallel(x, weight, bias, world):\n"
                 "    from labkit.tensor_parallel import RowParallelLinear as Row\n"
                 "    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)\n"
                 "    lin.weight = torch.nn.Parameter(weight)\n"
                 "    parts = [F.linear(xr, Row(lin, r, world).weight) for r, xr in enumerate(x.chunk(world, -1))]\n"
                 "    return sum(parts) + bias")


def test_notebook_10s_exercise_checks_keep_their_references_out_of_the_answers_reach():
    """Answers that look the expected value up in the notebook's globals (exercise 1's `problems`,
    exercise 2's `want`, two bypasses of the issue-27 version) find nothing there: each check fails."""
    import torch
    import labkit as lk
    from labkit import zero
    from labkit.estimate import model_states
    nb, P, world = "10_zero_and_fsdp.ipynb", 10**6, 2
    base = dict(torch=torch, lk=lk, zero=zero, model_states=model_states, STAGES=zero.STAGES, P=P, WORLD=world,
                states=lambda stage: model_states(P, dp=world, zero=stage))
    first, second = 'with lk.exercise(1, "write my_reduce_scatter', 'with lk.exercise(2, "write states_per_param'
    with pytest.raises(NameError, match="problems"):
        _nb3_check(nb, first, dict(base), "def my_reduce_scatter(grads, rank):\n"
                   "    return next(want[rank] for g, _, want in problems if g is grads)")
    with pytest.raises(NameError, match="want"):
        _nb3_check(nb, second, dict(base), "def states_per_param(stage, n):\n    return want[stage, n]")


def test_notebook_10s_exercise_3_wants_the_weight_gathered_again_not_the_global_one():
    """An unpack that gathers (to be counted) but returns a view of the notebook's global full weight `W3`
    gives the right gradient without using the gathered copy: refused by the check's look at what unpack returns."""
    import torch
    import labkit as lk
    from labkit import zero
    nb = "10_zero_and_fsdp.ipynb"
    base = dict(torch=torch, lk=lk, zero=zero)
    exec(_cell_defining(nb, "def gather():"), base)
    check = 'with lk.exercise(3, "write pack() and unpack() above"'
    with pytest.raises(AssertionError, match="gathered again"):
        _nb3_check(nb, check, dict(base), "def pack(t):\n"
                   "    return t.size() if t.untyped_storage().data_ptr() in gathered else t\n\n"
                   "def unpack(saved):\n    if isinstance(saved, torch.Tensor):\n        return saved\n"
                   "    gather()\n    return W3.t()")


def test_notebook_11s_kept_intermediates_check_refuses_the_measured_number():
    """Exercise 1 answered with the number lk.track printed (`mincut["kept"]`) fails on the graph the check
    makes by hand; the answer key passes (the compiled layer's graph and measurement stood in for by that
    hand-made graph and its known 3,104 bytes)."""
    import torch
    import labkit as lk
    nb = "11_compile_and_engines.ipynb"
    graph = torch.fx.Graph()
    for name, dtype in (("primals_1", torch.float32), ("mm", torch.float32), ("tangents_1", torch.float32)):
        graph.placeholder(name).meta["val"] = torch.empty(8, 97, dtype=dtype, device="meta")
    graph.output(None)
    base = dict(torch=torch, lk=lk, backward_graphs=[graph], mincut={"kept": 8 * 97 * 4})
    check = 'with lk.exercise(1, "write kept_intermediates(graph) above")'
    _nb3_check(nb, check, dict(base), _nb3_solution(nb, "def kept_intermediates("))
    with pytest.raises(AssertionError, match="made by hand"):
        _nb3_check(nb, check, dict(base), "def kept_intermediates(graph):\n    return 1, mincut['kept']")
