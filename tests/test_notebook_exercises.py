"""The notebooks' exercise checks, run from the notebooks' own cells: the answer key passes; plausible wrong answers
(a constant, the unsharded computation, a copy that saves nothing, the check's own reference) fail; an answer
that reaches the taught code, labkit's or PyTorch's, by any route is refused by name; a stub is "not attempted"."""
import contextlib
import io
import json
import re
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from conftest import NOTEBOOKS_DIR, code_cells, notebook_cell
from labkit import pipeline_parallel, tensor_parallel


def key(name, text):
    """The answer key: the code cell of notebook `name` containing `text`, its solution markers dropped."""
    return notebook_cell(name, text).replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", "")


def solution(name, grade_id):
    """The answer key of notebook `name` by its nbgrader grade_id, solution markers kept (they are comments)."""
    cells = json.loads((NOTEBOOKS_DIR / name).read_text())["cells"]
    [src] = ["".join(c["source"]) for c in cells if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id]
    return src


def run_check(name, text, ns, answer):
    """Runs the check cell of notebook `name` containing `text` after `answer` (the learner's definitions), and
    the helper cell it calls where it has one (02's scaler_trace)."""
    exec(answer, ns)
    src = notebook_cell(name, text)
    if "scaler_trace(" in src and "def scaler_trace(" not in src:
        exec(notebook_cell(name, "def scaler_trace("), ns)
    exec(src, ns)


def refused(name, text, ns, answer, calls="labkit"):
    with pytest.raises(AssertionError, match=f"your answer calls {calls}"):
        run_check(name, text, ns, answer)


def run_with_setup(name, setup, answer, check, ns=None):
    """Runs the cells of `name` containing each of `setup`, then `answer`, then the check cell containing `check`."""
    ns = {} if ns is None else ns
    for text in setup:
        exec(notebook_cell(name, text), ns)
    run_check(name, check, ns, answer)
    return ns


def after_parameters(name, answer, check):
    """Runs notebook `name`'s parameters cell, then `answer` (the learner's cell), then the check cell containing
    `check`, in one fresh namespace; returns what they printed."""
    ns, out = {}, io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(next(src for _, src in code_cells(NOTEBOOKS_DIR / name)), ns)
        ns.setdefault("cfg", ns.get("CONFIG"))
        exec(answer, ns)
        exec(notebook_cell(name, check), ns)
    return out.getvalue()


def printed(ns, answer, check):
    """Runs `answer`, then the check's source `check`, in `ns`; returns what the check printed."""
    exec(answer, ns)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(check, ns)
    return out.getvalue()


# ---- notebook 00 ---------------------------------------------------------------------------------------------
def test_notebook_00s_storage_check_refuses_labkits_own_counting():
    """Exercise 1 (distinct storage bytes) answered with labkit.estimate's own storage counter, reached
    through sys.modules, or with lk.track held in a default argument: both refused; the answer key passes."""
    import torch
    import labkit as lk
    nb, check = "00_start_here.ipynb", 'with lk.exercise(1, "complete storage_bytes() above"'
    base = dict(torch=torch, lk=lk)
    run_check(nb, check, dict(base), key(nb, "def storage_bytes("))
    private = ("def storage_bytes(tensors):\n    import sys\n"
               "    return sys.modules['labkit.estimate.step'].storage_bytes(tensors)")
    tracked = ("def storage_bytes(tensors, _track=lk.track):\n    with _track(tensors) as m:\n        pass\n"
               "    return m.live")
    for answer in (private, tracked):
        refused(nb, check, dict(base), answer)


def test_notebook_00s_storage_check_refuses_pytorchs_tracker_and_fails_a_copied_reference():
    """Exercise 1 answered with PyTorch's MemTracker (a storage counter too) is refused; an answer that returns
    the first list's reference (a global of the check) fails on the second list."""
    import torch
    import labkit as lk
    nb, check = "00_start_here.ipynb", 'with lk.exercise(1, "complete storage_bytes() above"'
    theirs = ("def storage_bytes(tensors):\n    from torch.distributed._tools.mem_tracker import MemTracker\n"
              "    tracker = MemTracker()\n    tracker.track_external(*tensors)\n    with tracker:\n        pass\n"
              "    return tracker.get_tracker_snapshot('current')[torch.device('cpu')]['Total']")
    refused(nb, check, dict(torch=torch, lk=lk), theirs, calls="torch.distributed._tools.mem_tracker")
    with pytest.raises(AssertionError, match="must equal the live bytes"):
        run_check(nb, check, dict(torch=torch, lk=lk), "def storage_bytes(tensors):\n    return cases[0][1]")


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
    run_check(nb, check, dict(base), key(nb, "def states_per_param("))
    untracked = ("def states_per_param(make_optimizer):\n    o = make_optimizer(model.parameters())\n"
                 "    ids = next(batches)\n    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()\n"
                 "    o.step()\n    o.zero_grad(set_to_none=True)\n    return 8.0")
    with pytest.raises(AssertionError, match="SGD with momentum: one step"):
        run_check(nb, check, dict(base), untracked)
    for answer in ("def states_per_param(make_optimizer):\n    return 8.0",
                   "def states_per_param(make_optimizer):\n    return want"):
        with pytest.raises(AssertionError, match="weights did not move"):
            run_check(nb, check, dict(base), answer)


# ---- notebook 01 ---------------------------------------------------------------------------------------------
def _nb01_saved_bytes_namespace():
    """Notebook 01's parameters cell and its per-family cell (lk.track's one-layer reference), run at tiny size."""
    import contextlib
    import io
    nb, ns = "01_memory_anatomy.ipynb", {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(next(src for _, src in code_cells(NOTEBOOKS_DIR / nb)), ns)
        exec("import importlib\nfrom labkit.estimate import activation_bytes_per_token", ns)
        exec(notebook_cell(nb, "one_layer = {}"), ns)
    return ns


def test_notebook_01s_saved_bytes_check_refuses_labkits_counters_by_any_route():
    """Exercise 2 (what autograd keeps) answered with lk.track held in a default argument, or with labkit's
    SavedBytesByDevice reached through sys.modules: both refused; the answer key passes; counting every save
    without merging shared storages fails on the bytes."""
    nb, check = "01_memory_anatomy.ipynb", 'with lk.exercise(2, "complete saved_bytes() above"'
    run_check(nb, check, _nb01_saved_bytes_namespace(), key(nb, "def saved_bytes("))
    held = ("def saved_bytes(model, ids, _track=lk.track):\n    with _track(model) as m:\n"
            "        out = model(input_ids=ids, use_cache=False)\n    return m.at('forward end')['activations']")
    module = ("def saved_bytes(model, ids):\n    import sys\n"
              "    with sys.modules['labkit.copies'].SavedBytesByDevice() as s:\n"
              "        out = model(input_ids=ids, use_cache=False)\n"
              "    return sum(s.bytes.values()) - sum(p.nbytes for p in model.parameters())")
    for answer in (held, module):
        refused(nb, check, _nb01_saved_bytes_namespace(), answer)
    every_save = ("def saved_bytes(model, ids):\n    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}\n"
                  "    total = []\n    def pack(t):\n        if t.untyped_storage().data_ptr() not in weights:\n"
                  "            total.append(t.untyped_storage().nbytes())\n        return t\n"
                  "    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):\n"
                  "        out = model(input_ids=ids, use_cache=False)\n    return sum(total)")
    with pytest.raises(AssertionError, match="each once"):
        run_check(nb, check, _nb01_saved_bytes_namespace(), every_save)


# ---- notebook 02 ---------------------------------------------------------------------------------------------
def test_notebook_02s_scaler_check_refuses_pytorchs_own_scaling():
    """Exercise 1 (a dynamic loss scaler) answered with GradScaler's two kernels called directly
    (torch._amp_foreach_non_finite_check_and_unscale_, torch._amp_update_scale_: the bypass of issue 27),
    the same kernels through torch.ops.aten, or a GradScaler subclass: all refused; the answer key passes."""
    import torch
    import labkit as lk
    nb, check = "02_mixed_precision.ipynb", 'with lk.exercise(1, "complete LossScaler above"'
    base = dict(torch=torch, lk=lk, DEVICE=torch.device("cpu"))
    run_check(nb, check, dict(base), key(nb, "class LossScaler:"))
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
        refused(nb, check, dict(base), answer, calls="torch")


def test_notebook_02s_checks_refuse_fsdps_scaler_and_the_checks_own_measurement():
    """Exercise 1 answered with FSDP's ShardedGradScaler, whose CPU path re-implements the scale update in
    Python (no GradScaler method, no kernel), is refused."""
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
    refused(nb, 'with lk.exercise(1, "complete LossScaler above"', dict(base), sharded,
            calls="torch.distributed.fsdp.sharded_grad_scaler")


# exercise 2: fp32 master weights
NB02 = "02_mixed_precision.ipynb"
SETUP02 = ["PRESET = \"llama-2-7b\"", "def flat(tensors", "def train(autocast=None", "def agreement(run, ref):",
           "def round_stochastic(x):"]
CHECK02 = "def check_master_weights():"


def test_notebook_02s_master_weights_check_passes_the_key_and_fails_pure_bf16(capsys):
    """The answer key passes; an answer without a master copy (AdamW straight on the bf16 weights, which the
    notebook shows losing most updates at FT_LR) fails on the cosine, as does one that keeps no `master`."""
    run_with_setup(NB02, SETUP02, key(NB02, "class MasterWeights:"), CHECK02)
    assert "Exercise 2: passed" in capsys.readouterr().out
    no_master = ("class MasterWeights:\n    def __init__(self, params, lr, **adamw):\n"
                 "        self.params = list(params)\n        self.master = self.params\n"
                 "        self.adamw = torch.optim.AdamW(self.params, lr=lr, **adamw)\n"
                 "    def step(self):\n        self.adamw.step()\n"
                 "    def zero_grad(self, set_to_none=True):\n        self.adamw.zero_grad(set_to_none=True)\n")
    with pytest.raises(AssertionError, match="master copies must move where fp32's weights move"):
        run_with_setup(NB02, SETUP02, no_master, CHECK02)


def test_notebook_02s_master_weights_check_refuses_kahan_summation():
    """An answer that reaches for the notebook's Kahan `apply` instead of a master copy is refused."""
    kahan = ("class MasterWeights:\n    def __init__(self, params, lr, **adamw):\n"
             "        self.params, self.master = list(params), None\n"
             "    def step(self):\n        apply(self.params[0].detach(), self.params[0].detach(), 1, 'Kahan')\n"
             "    def zero_grad(self, set_to_none=True):\n        pass\n")
    with pytest.raises(AssertionError, match="your answer calls apply"):
        run_with_setup(NB02, SETUP02, kahan, CHECK02)


# ---- notebook 03 ---------------------------------------------------------------------------------------------
def test_notebook_03s_recompute_check_refuses_torch_checkpointing_by_any_route():
    """Exercise 1 (checkpointing from scratch) answered with torch.utils.checkpoint imported under an alias,
    its reentrant CheckpointFunction held in a default argument, or reached through sys.modules: each refused
    (the whole module is forbidden); the answer key passes."""
    nb, check = "03_activation_checkpointing.ipynb", 'with lk.exercise(1, "complete Recompute above"'
    assert "Exercise 1: passed" in after_parameters(nb, key(nb, "class Recompute("), check)
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
            after_parameters(nb, answer, check)


# exercise 2: checkpoint only the MLPs
NB03 = "03_activation_checkpointing.ipynb"
SETUP03 = ["LAYERS = 16", "class Segment(torch.nn.Module):", "CPU_SDPA = {"]
CHECK03 = "def check_checkpoint_mlps(layers=2):"


def ns03():
    """Notebook 03's parameters cell and its correctness helpers (the batch, TOL, gradient_error), at tiny size."""
    ns = {}
    exec(notebook_cell(NB03, "LAYERS = 16"), ns)
    exec(notebook_cell(NB03, "def gradient_error(grads, ref):"), ns)
    ns.update(cfg=ns["CONFIG"])
    return ns


def test_notebook_03s_mlp_checkpointing_check_passes_the_key_and_fails_no_checkpointing(capsys):
    """The key passes (gradients equal, four (T, i) tensors per layer fewer, gate and up recomputed once);
    returning the model unchanged fails on the bytes kept."""
    run_with_setup(NB03, SETUP03, key(NB03, "def checkpoint_mlps(model):"), CHECK03, ns03())
    assert "Exercise 2: passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="four \\(T, i\\) tensors per layer"):
        run_with_setup(NB03, SETUP03, "def checkpoint_mlps(model):\n    return model\n", CHECK03, ns03())


def test_notebook_03s_mlp_checkpointing_check_refuses_the_notebooks_segment():
    """Wrapping each MLP in the notebook's own Segment (which would work) is refused: write it yourself."""
    via_segment = ("def checkpoint_mlps(model):\n    for layer in model.model.layers:\n"
                   "        layer.mlp = Segment([layer.mlp])\n    return model\n")
    with pytest.raises(AssertionError, match="your answer calls Segment"):
        run_with_setup(NB03, SETUP03, via_segment, CHECK03, ns03())


@pytest.mark.parametrize("nb, solution, setup, check", [
    (NB02, "class MasterWeights:", SETUP02, CHECK02),
    (NB03, "def checkpoint_mlps(model):", SETUP03, CHECK03)], ids=["02-ex2", "03-ex2"])
def test_the_student_builds_stub_is_not_attempted(nb, solution, setup, check, capsys):
    """The student build's stub (solutions replaced by `raise NotImplementedError()`) reports "not attempted"."""
    from labkit.course import strip_solutions
    run_with_setup(nb, setup, strip_solutions(notebook_cell(nb, solution)), check, ns03() if nb == NB03 else None)
    out = capsys.readouterr().out
    assert "Exercise 2 not attempted yet" in out and "passed" not in out


# ---- notebook 05 ---------------------------------------------------------------------------------------------
def test_notebook_05s_allocator_checks_refuse_labkit_alloc_and_hide_their_reference():
    """Exercises 1 and 2 (best fit, rounding) answered through labkit.alloc (a default argument, sys.modules,
    an aliased import): refused. An answer that looks the expected values up in the notebook's globals (the
    reference lists used to be globals, and that bypass passed) finds nothing and fails."""
    nb = "05_caching_allocator.ipynb"
    first, second = 'with lk.exercise(1, "write my_best_fit() above"', 'with lk.exercise(2, "write my_round_size() above"'
    assert "Exercise 1: passed" in after_parameters(nb, key(nb, "def my_best_fit("), first)
    assert "Exercise 2: passed" in after_parameters(nb, key(nb, "def my_round_size("), second)
    via_alloc = [
        (first, "def my_best_fit(free_blocks, size, max_split=None, _A=Allocator):\n    _A()\n    return None"),
        (first, "import sys\ndef my_best_fit(free_blocks, size, max_split=None):\n"
                "    return sys.modules['labkit.alloc'].round_size(size, None)"),
        (second, "from labkit.alloc import round_size as rs, parse_conf as pc\n"
                 "def my_round_size(size, divisions):\n    return rs(size, pc(''))"),
    ]
    for check, answer in via_alloc:
        with pytest.raises(AssertionError, match="your answer calls labkit.alloc"):
            after_parameters(nb, answer, check)
    lookups = [
        (first, "def my_best_fit(free_blocks, size, max_split=None):\n    g = globals()\n"
                "    return next((t[3] for t in g.get('trials', ()) if t[:3] == (free_blocks, size, max_split)), None)"),
        (second, "def my_round_size(size, divisions):\n    g = globals()\n"
                 "    return g['expected'][g['tests'].index((size, divisions))]"),
    ]
    for check, answer in lookups:
        with pytest.raises((AssertionError, KeyError)):
            after_parameters(nb, answer, check)


# ---- notebook 06 ---------------------------------------------------------------------------------------------
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
    exec(notebook_cell(nb, "def blockwise("), ns)          # minilm, W, blockwise
    exec(notebook_cell(nb, "def nf4_codebook("), ns)       # NF4
    check = 'with lk.exercise(1, "complete nf4_quantize() above"'
    run_check(nb, check, dict(ns), key(nb, "def nf4_quantize("))
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
            run_check(nb, check, dict(ns), answer)


# ---- notebook 07 ---------------------------------------------------------------------------------------------
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
    run_check(nb, first, dict(base), key(nb, "def my_block_hashes("))
    refused(nb, first, dict(base), "def my_block_hashes(t, b, _lib=paged.block_hashes):\n    return _lib(t, b)")
    run_check(nb, second, dict(base), key(nb, "def admission("))
    refused(nb, second, dict(base), "def admission(free, total, need, watermark):\n"
                                    "    return fresh_tables(total * BLOCK).can_allocate(need * BLOCK)")
    refused(nb, first, dict(base), "import sys\ndef my_block_hashes(t, b):\n"
                                   "    return sys.modules['labkit.paged'].block_hashes(t, b)")
    refused(nb, first, dict(base), "from labkit.paged import block_hashes as h\n"
                                   "def my_block_hashes(t, b):\n    return h(t, b)")
    for answer in ("def my_block_hashes(t, b):\n    return references[shared_prompts.index(t)]",
                   "def admission(free, total, need, watermark):\n    return cases[0][4]"):
        with pytest.raises(NameError):            # the references are the check's locals, not globals
            run_check(nb, first if "hashes" in answer else second, dict(base), answer)


# exercises 3 (append) and 4 (copy-on-write): an answer that calls labkit.paged's block tables is refused by name,
# a trivial one fails (issue 28)
NB07 = "07_kv_cache_paged_attention.ipynb"


def run_block_table_check(check, answer):
    """Runs notebook 07's check cell containing `check` after `answer`, beside labkit.paged's block tables."""
    from labkit import paged
    from labkit.paged import BlockAllocator, BlockTables
    run_check(NB07, check, dict(lk=lk, paged=paged, BlockAllocator=BlockAllocator, BlockTables=BlockTables), answer)


APPEND, WRITE = "def check_append():", "def check_write_token():"
CALLS_TABLES = {
    APPEND: "def my_append(allocator, table, length, count):\n"
            "    t = BlockTables(allocator)\n    t.tables['s'], t.lengths['s'] = table, length\n"
            "    t.append('s', count)\n    return t.lengths['s']",
    WRITE: "def my_write_token(allocator, table, length, copies):\n"
           "    t = BlockTables(allocator)\n    t.tables['s'], t.lengths['s'] = table, length\n"
           "    t.append('s', 1)\n    copies.extend(t.take_copies())\n    return t.lengths['s']",
}
TRIVIAL = {
    APPEND: "def my_append(allocator, table, length, count):\n    return length + count",
    WRITE: "def my_write_token(allocator, table, length, copies):\n"          # grows, never copies
           "    if length % allocator.block_size == 0:\n        table.append(allocator.allocate())\n    return length + 1",
}
KEYS = {APPEND: "def my_append(allocator, table, length, count):", WRITE: "def my_write_token(allocator, table, length, copies):"}


@pytest.mark.parametrize("check", [APPEND, WRITE])
def test_notebook_07s_block_table_checks_pass_the_answer_key(check, capsys):
    run_block_table_check(check, key(NB07, KEYS[check]))
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("check", [APPEND, WRITE])
def test_notebook_07s_block_table_checks_refuse_the_librarys_block_tables(check):
    with pytest.raises(AssertionError, match=r"your answer calls labkit\.paged\.tables"):
        run_block_table_check(check, CALLS_TABLES[check])


@pytest.mark.parametrize("check", [APPEND, WRITE])
def test_notebook_07s_block_table_checks_fail_a_trivial_answer_without_showing_it_the_answer(check):
    with pytest.raises(AssertionError, match="(is|are) wrong") as failed:
        run_block_table_check(check, TRIVIAL[check])
    assert "expected" not in str(failed.value)


def test_notebook_07s_block_table_checks_hold_no_answer_in_a_global():
    for check in (APPEND, WRITE):
        source = notebook_cell(NB07, check)
        body = source.split(check, 1)[1]
        assert "reference" in body and "BlockTables(" in body, "the reference is computed inside the check function"


# ---- notebook 09 ---------------------------------------------------------------------------------------------
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
    run_check(nb, check, dict(base), key(nb, "def row_parallel("))
    refused(nb, check, dict(base), "def row_parallel(x, weight, bias, world):\n"
                 "    from labkit.tensor_parallel import RowParallelLinear as Row\n"
                 "    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)\n"
                 "    lin.weight = torch.nn.Parameter(weight)\n"
                 "    parts = [F.linear(xr, Row(lin, r, world).weight) for r, xr in enumerate(x.chunk(world, -1))]\n"
                 "    return sum(parts) + bias")


# exercises 2 (the smallest m), 3 (Megatron's f and g) and 4 (1F1B's order): the ranks' recorded 1F1B orders are
# stood in for by labkit's reference (tests/test_pipeline_parallel.py checks that torch's Schedule1F1B ran exactly it)
NB09 = "09_tensor_and_pipeline_parallelism.ipynb"


def _ns3():
    ns = dict(torch=torch, F=F, lk=lk, tensor_parallel=tensor_parallel)
    exec(notebook_cell(NB09, "def all_reduce(stacked):"), ns)
    return ns


def _ns4():
    def bubbles(timeline):
        step = max(end for stage in timeline for *_, end in stage)
        return [1 - Fraction(sum(end - start for *_, start, end in stage), step) for stage in timeline]

    def pct(xs):
        return " / ".join(f"{float(x):.1%}" for x in xs)

    p, ms = 2, (2, 4, 8)
    rows = {("1F1B", m, s): {"events": [[k, c, 0.0, 0.0] for k, c in pipeline_parallel.one_f_one_b(p, m)[s]]} for m in ms for s in range(p)}
    return dict(torch=torch, lk=lk, pipeline_parallel=pipeline_parallel, replay=pipeline_parallel.replay, Fraction=Fraction, bubbles=bubbles, pct=pct,
                p=p, pp={"microbatches": list(ms)}, rows=rows)


F_G = solution(NB09, "09-ex3-solution")
CHECK3 = notebook_cell(NB09, "check_exercise_3()")


def test_notebook_09s_exercise_3_passes_the_key_with_one_all_reduce_each_way():
    out = printed(_ns3(), F_G, CHECK3)
    assert "Exercise 3: passed" in out and "1 in forward, 1 in backward" in out


@pytest.mark.parametrize("wrong, message", [
    (("        return all_reduce(grad)", "        return grad"), "input gradient is not the whole one"),     # f: no all-reduce
    (("        return all_reduce(x)", "        return x.view_as(x)"), "output differs"),                    # g: no all-reduce
    (("        return grad", "        return all_reduce(grad)"), "gradient"),                                # g: all-reduce back: N times
    (("        return x.view_as(x)", "        return all_reduce(x)"), "output differs"),                   # f: all-reduce forward
])
def test_notebook_09s_exercise_3_fails_each_wrong_half_of_f_and_g(wrong, message):
    old, new = wrong
    answer = re.sub(r"\s*### (BEGIN|END) SOLUTION", "", F_G)
    assert old in answer
    if old == "        return grad":                                        # Reduce.backward is the last `return grad`
        head, _, tail = answer.rpartition(old)
        answer = head + new + tail
    else:
        answer = answer.replace(old, new, 1)
    with pytest.raises(AssertionError, match=message):
        printed(_ns3(), answer, CHECK3)


def test_notebook_09s_exercise_3_refuses_labkits_own_f_and_g():
    answer = "from labkit.tensor_parallel import CopyToParallel as Copy, ReduceFromParallel as Reduce\n"
    with pytest.raises(AssertionError, match="your answer calls"):
        printed(_ns3(), answer, CHECK3)


CHECK4 = notebook_cell(NB09, "check_exercise_4()")


def test_notebook_09s_exercise_4_passes_the_answer_key():
    out = printed(_ns4(), solution(NB09, "09-ex4-solution"), CHECK4)
    assert "Exercise 4: passed" in out and "p = 8, m = 3" in out


def test_notebook_09s_exercise_4_refuses_gpipes_order_a_long_warm_up_and_labkits_reference():
    gpipe = ("def one_f_one_b_order(p, m):\n"
             "    return [[('F', c) for c in range(m)] + [('B', c) for c in range(m)] for _ in range(p)]\n")
    with pytest.raises(AssertionError, match="GPipe's order, not 1F1B's"):
        printed(_ns4(), gpipe, CHECK4)
    torch_warm_up = solution(NB09, "09-ex4-solution").replace("warm = min(p - 1 - s, m)", "warm = min(p - s, m)")
    with pytest.raises(AssertionError, match="GPipe's order, not 1F1B's|is not the order 1F1B runs"):
        printed(_ns4(), torch_warm_up, CHECK4)
    with pytest.raises(AssertionError, match="your answer calls labkit.pipeline_parallel.one_f_one_b"):
        printed(_ns4(), "def one_f_one_b_order(p, m, _ref=pipeline_parallel.one_f_one_b):\n    return _ref(p, m)\n", CHECK4)


def test_notebook_09s_exercise_4_stub_is_not_attempted():
    stub = "def one_f_one_b_order(p, m):\n    raise NotImplementedError()\n"
    assert "not attempted yet" in printed(_ns4(), stub, CHECK4)


CHECK2 = notebook_cell(NB09, "check_exercise_2()")


def test_notebook_09s_exercise_2_shows_the_replayed_answers_only_once_an_answer_passes():
    stub = "def smallest_microbatches(p, target):\n    raise NotImplementedError()\n"
    out = printed(_ns4(), stub, CHECK2)
    assert "not attempted yet" in out and "m = " not in out, out
    out = printed(_ns4(), solution(NB09, "09-ex2-solution"), CHECK2)
    assert "Exercise 2: passed" in out and "p = 8, bubble under 1/10 = 10.00%: m = 64" in out, out


def test_notebook_09s_exercise_2_takes_an_exact_closed_form_and_refuses_the_same_in_floats():
    exact = "import math\ndef smallest_microbatches(p, target):\n    return math.floor((p - 1) * (1 - target) / target) + 1\n"
    assert "Exercise 2: passed" in printed(_ns4(), exact, CHECK2)
    floats = exact.replace("    return", "    target = float(target)\n    return")
    with pytest.raises(AssertionError, match="m = 63 is not the smallest m whose bubble is below it"):
        printed(_ns4(), floats, CHECK2)


# ---- notebook 10 ---------------------------------------------------------------------------------------------
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
    run_check(nb, first, dict(base), key(nb, "def my_reduce_scatter("))
    refused(nb, first, dict(base), "def my_reduce_scatter(grads, rank):\n    from labkit.zero import shard\n"
                                   "    return shard(sum(grads) / len(grads), rank, len(grads))")
    run_check(nb, second, dict(base), key(nb, "def states_per_param("))
    refused(nb, second, dict(base), "def states_per_param(stage, n):\n    from labkit.estimate import model_states as m\n"
                                    "    return {c: b / (10**6 * n) for c, b in m(10**6 * n, dp=n, zero=stage).items()}")


def test_notebook_10s_exercise_3_wants_the_gathered_weight_gone_after_forward():
    """ZeRO-3's pack/unpack: the answer key passes; a pack that keeps the tensor (the graph then holds the
    gathered weight until backward) fails, and so does one that calls labkit.zero's own `Zero3.pack`."""
    import torch
    import labkit as lk
    from labkit import zero
    nb = "10_zero_and_fsdp.ipynb"
    base = dict(torch=torch, lk=lk, zero=zero)
    exec(notebook_cell(nb, "def gather():"), base)
    check = 'with lk.exercise(3, "write pack() and unpack() above"'
    run_check(nb, check, dict(base), key(nb, "def pack(t):"))
    with pytest.raises(AssertionError, match="still holds the gathered weight"):
        run_check(nb, check, dict(base), "def pack(t):\n    return t\n\ndef unpack(saved):\n    return saved")
    refused(nb, check, dict(base), "def pack(t):\n    engine = zero.Zero3.__new__(zero.Zero3)\n"
                                   "    engine._gathered = dict.fromkeys(gathered, 0)\n    return zero.Zero3.pack(engine, t)\n"
                                   "def unpack(saved):\n    return saved")


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
        run_check(nb, first, dict(base), "def my_reduce_scatter(grads, rank):\n"
                   "    return next(want[rank] for g, _, want in problems if g is grads)")
    with pytest.raises(NameError, match="want"):
        run_check(nb, second, dict(base), "def states_per_param(stage, n):\n    return want[stage, n]")


def test_notebook_10s_exercise_3_wants_the_weight_gathered_again_not_the_global_one():
    """An unpack that gathers (to be counted) but returns a view of the notebook's global full weight `W3`
    gives the right gradient without using the gathered copy: refused by the check's look at what unpack returns."""
    import torch
    import labkit as lk
    from labkit import zero
    nb = "10_zero_and_fsdp.ipynb"
    base = dict(torch=torch, lk=lk, zero=zero)
    exec(notebook_cell(nb, "def gather():"), base)
    check = 'with lk.exercise(3, "write pack() and unpack() above"'
    with pytest.raises(AssertionError, match="gathered again"):
        run_check(nb, check, dict(base), "def pack(t):\n"
                   "    return t.size() if t.untyped_storage().data_ptr() in gathered else t\n\n"
                   "def unpack(saved):\n    if isinstance(saved, torch.Tensor):\n        return saved\n"
                   "    gather()\n    return W3.t()")


# ---- notebook 11 ---------------------------------------------------------------------------------------------
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
    run_check(nb, check, dict(base), key(nb, "def kept_intermediates("))
    with pytest.raises(AssertionError, match="made by hand"):
        run_check(nb, check, dict(base), "def kept_intermediates(graph):\n    return 1, mincut['kept']")
