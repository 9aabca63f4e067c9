"""What a notebook may assert, print and show: checks on the notebooks' source, and the claims its cells make.

At tiny size a notebook asserts counted work (bytes, FLOPs, events), never wall-clock time: CI and
learners run on different, shared CPUs. Time may be asserted only under a GPU guard. A notebook shows the
code it teaches with lk.show and calls no private labkit name. (Its exercise checks: test_notebook_exercises.py.)
"""
import ast
import json
import pathlib
import re

import importlib.util

import pytest

from conftest import code_cells, notebook_cell

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
    exec(notebook_cell("03_activation_checkpointing.ipynb", "SAVE = {"), ns)
    fused = sorted(n for n in torch._C._dispatch_get_all_op_names()       # "aten::name" or "aten::name.overload"
                   if n.startswith("aten::_scaled_dot_product_") and "." not in n
                   and "backward" not in n and "attention_math" not in n)
    assert "aten::_scaled_dot_product_cudnn_attention" in fused
    missing = [n for n in fused if getattr(torch.ops.aten, n.split("::")[1]).default not in ns["SAVE"]]
    assert not missing, f"notebook 03's selective policy recomputes attention under {missing}"


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


def test_notebook_00s_allocator_cell_accepts_a_plausible_allocator_and_refuses_impossible_ones(monkeypatch):
    """The CUDA branch of 00's allocator cell, run on a CPU: lk.track stands in for the allocator's books
    (mem.cuda) with chosen figures. Growth equal to the tracker's plus 512-byte rounding and some workspace
    passes; an allocator that grew less than the tracker counted, or far more than rounding and workspace
    allow, fails the cell's assert."""
    import types
    import torch
    import labkit as lk
    src = notebook_cell("00_start_here.ipynb", "step_mem.cuda is None")
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
    exec(notebook_cell("01_memory_anatomy.ipynb", "def allocator_books("), ns)
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


def test_bf16_rounding_error_reaches_2_to_the_minus_8_not_minus_9():
    """Round to nearest with 8 significant bits: the relative error reaches 2^-8 (bf16's unit roundoff),
    so notebook 04's bound is 2^-8; with 2^-9 its assert fails."""
    import torch
    values = torch.randn(2**20, generator=torch.Generator().manual_seed(0))
    rounding = ((values.bfloat16().float() - values).abs() / values.abs()).max().item()
    assert 2**-9 < rounding <= 2**-8
    assert not rounding <= 2**-9
    assert "2**-9 < rounding <= 2**-8" in notebook_cell("04_cpu_offload.ipynb", "rounding = ((values.bfloat16()")


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


# ---- the code a notebook shows: with lk.show, no private labkit name, short cells ---------------------------
SHOWN = ["08_flash_attention", "12_profiling_and_kernels"]
PRIVATE = re.compile(r"\b(?:lk|flash|flash_triton|kernels|profiling)\.(_[A-Za-z]\w*)")


def code(name):
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


@pytest.mark.parametrize("name", SHOWN)
def test_taught_code_is_shown_with_lk_show_not_inspect(name):
    sources = code(name)
    assert not [s for s in sources if "inspect.getsource" in s or "Code(" in s]
    assert any("lk.show(" in s for s in sources)


@pytest.mark.parametrize("name", SHOWN)
def test_no_private_labkit_name_is_called_or_shown(name):
    found = [m.group(0) for s in code(name) for m in PRIVATE.finditer(s)]
    assert not found, found


def test_the_private_name_check_finds_what_it_should():
    assert PRIVATE.search("lk.show(flash._flash_fwd.fn)") and PRIVATE.search("profiling._coalesce(t)")
    assert not PRIVATE.search("lk.show(flash.kernel_code('forward'))") and not PRIVATE.search("x.__class__")


def test_notebooks_09_and_10_show_code_with_lk_show_call_no_private_name_and_keep_cells_short():
    import nbformat
    for name in ("09_tensor_and_pipeline_parallelism", "10_zero_and_fsdp"):
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "inspect.getsource" not in source and "Code(" not in source, name
        private = re.findall(r"(?<![A-Za-z0-9_])(?:zero|tensor_parallel|pipeline_parallel|launch|lk)\.(?:\w+\.)*_[a-z]\w*", source)
        assert not private, (name, "private labkit names", private)
        long = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and len(c.source.splitlines()) > 30]
        assert not long, (name, "cells over 30 lines", long)


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
