"""Notebooks 02-04 (issue 28): their new exercise checks against hostile answers, and labkit.offload's new
counters (the seed's Swapper as written, saved bytes by device, hooks counted from outside, the bf16 bound)."""
import json
import pathlib
import tracemalloc

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit as lk
from labkit import copies, offload
from labkit.copies import CountedHooks, CrossDeviceCopies, GradWeightCopies, SavedBytesByDevice
from labkit.offload import ActivationOffload, HostAdam, SeedSwapper, Swapper

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cell(name, text):
    """The source of the one code cell of notebook `name` that contains `text`."""
    cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
    found = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and text in "".join(c["source"])]
    assert len(found) == 1, f"{name}: {len(found)} code cells contain {text!r}"
    return found[0]


def key(name, text):
    """The answer key: the cell containing `text`, its solution markers dropped."""
    return cell(name, text).replace("### BEGIN SOLUTION", "").replace("### END SOLUTION", "")


def run(name, setup, answer, check, ns=None):
    """Runs the cells of `name` containing each of `setup`, then `answer`, then the check cell containing `check`."""
    ns = {} if ns is None else ns
    for text in setup:
        exec(cell(name, text), ns)
    exec(answer, ns)
    exec(cell(name, check), ns)
    return ns


# ---- notebook 02, exercise 2: fp32 master weights ---------------------------------------------------------
NB02 = "02_mixed_precision.ipynb"
SETUP02 = ["PRESET = \"llama-2-7b\"", "def flat(tensors", "def train(autocast=None", "def agreement(run, ref):",
           "def round_stochastic(x):"]
CHECK02 = "def check_master_weights():"


def test_notebook_02s_master_weights_check_passes_the_key_and_fails_pure_bf16(capsys):
    """The answer key passes; an answer without a master copy (AdamW straight on the bf16 weights, which the
    notebook shows losing most updates at FT_LR) fails on the cosine, as does one that keeps no `master`."""
    run(NB02, SETUP02, key(NB02, "class MasterWeights:"), CHECK02)
    assert "Exercise 2: passed" in capsys.readouterr().out
    no_master = ("class MasterWeights:\n    def __init__(self, params, lr, **adamw):\n"
                 "        self.params = list(params)\n        self.master = self.params\n"
                 "        self.adamw = torch.optim.AdamW(self.params, lr=lr, **adamw)\n"
                 "    def step(self):\n        self.adamw.step()\n"
                 "    def zero_grad(self, set_to_none=True):\n        self.adamw.zero_grad(set_to_none=True)\n")
    with pytest.raises(AssertionError, match="master copies must move where fp32's weights move"):
        run(NB02, SETUP02, no_master, CHECK02)


def test_notebook_02s_master_weights_check_refuses_kahan_summation():
    """An answer that reaches for the notebook's Kahan `apply` instead of a master copy is refused."""
    kahan = ("class MasterWeights:\n    def __init__(self, params, lr, **adamw):\n"
             "        self.params, self.master = list(params), None\n"
             "    def step(self):\n        apply(self.params[0].detach(), self.params[0].detach(), 1, 'Kahan')\n"
             "    def zero_grad(self, set_to_none=True):\n        pass\n")
    with pytest.raises(AssertionError, match="your answer calls apply"):
        run(NB02, SETUP02, kahan, CHECK02)


# ---- notebook 03, exercise 2: checkpoint only the MLPs -----------------------------------------------------
NB03 = "03_activation_checkpointing.ipynb"
SETUP03 = ["LAYERS = 16", "class Segment(torch.nn.Module):", "CPU_SDPA = {"]
CHECK03 = "def check_checkpoint_mlps(layers=2):"


def ns03():
    """Notebook 03's parameters cell and its correctness helpers (the batch, TOL, gradient_error), at tiny size."""
    ns = {}
    exec(cell(NB03, "LAYERS = 16"), ns)
    exec(cell(NB03, "def gradient_error(grads, ref):"), ns)
    ns.update(cfg=ns["CONFIG"])
    return ns


def test_notebook_03s_mlp_checkpointing_check_passes_the_key_and_fails_no_checkpointing(capsys):
    """The key passes (gradients equal, four (T, i) tensors per layer fewer, gate and up recomputed once);
    returning the model unchanged fails on the bytes kept."""
    run(NB03, SETUP03, key(NB03, "def checkpoint_mlps(model):"), CHECK03, ns03())
    assert "Exercise 2: passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="four \\(T, i\\) tensors per layer"):
        run(NB03, SETUP03, "def checkpoint_mlps(model):\n    return model\n", CHECK03, ns03())


def test_notebook_03s_mlp_checkpointing_check_refuses_the_notebooks_segment():
    """Wrapping each MLP in the notebook's own Segment (which would work) is refused: write it yourself."""
    via_segment = ("def checkpoint_mlps(model):\n    for layer in model.model.layers:\n"
                   "        layer.mlp = Segment([layer.mlp])\n    return model\n")
    with pytest.raises(AssertionError, match="your answer calls Segment"):
        run(NB03, SETUP03, via_segment, CHECK03, ns03())


# ---- labkit.offload: the seed's Swapper, saved bytes by device, hooks counted from outside -----------------
def mlps(device, n=2):
    return [layer.mlp for layer in lk.models.build("llama-2-7b", "tiny", device=device, num_hidden_layers=n).model.layers]


def test_the_seeds_swapper_as_written_fails_on_a_module_on_the_device():
    """`x = x.cpu(); x = self.module(x); return x.cuda()` with the module on the device ("meta" standing in
    for a GPU under FakeTensorMode) is an op across two devices: refused, as on a GPU."""
    stack = torch.nn.Sequential(*(SeedSwapper(m, "meta") for m in mlps("meta")))
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(2, 8, lk.models.config("llama-2-7b", "tiny").hidden_size, device="meta")
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            stack(x)


def test_the_seeds_swapper_runs_the_layer_on_the_host_and_the_corrected_one_on_the_device():
    """With the module on the host the seed's version runs it there: its saved tensors are all on the host;
    the corrected Swapper keeps them on the device. Both move each layer's input and output once each way."""
    h = lk.models.config("llama-2-7b", "tiny").hidden_size
    out = {}
    for name, wrapper, where, start in (("seed", SeedSwapper, "cpu", "meta"), ("fixed", Swapper, "meta", "cpu")):
        stack = torch.nn.Sequential(*(wrapper(m, "meta", host="cpu") for m in mlps(where)))
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(2, 8, h, device=start, requires_grad=True)
            with CrossDeviceCopies() as moved, SavedBytesByDevice() as saved:
                stack(x).sum().backward()
        out[name] = moved.routes, saved.bytes
    act = 2 * 8 * h * 4
    assert out["seed"][0] == {"meta->cpu": 2 * 2 * act, "cpu->meta": 2 * 2 * act} == out["fixed"][0]
    assert set(out["seed"][1]) == {"cpu"} and out["fixed"][1] == {"meta": out["seed"][1]["cpu"]}


def test_saved_bytes_by_device_counts_a_storage_saved_twice_once():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)
    with SavedBytesByDevice() as saved:
        (x @ w).sum() + (x @ w.t()).sum()         # x saved by both matmuls, w by neither (x needs no grad)
    assert saved.bytes == {"cpu": x.nbytes}


def test_counted_hooks_count_what_activation_offload_moves_from_outside():
    """CountedHooks around ActivationOffload: every moved save is unpacked once, and the bytes unpack returns
    equal ActivationOffload's bytes back (host), twice them for bf16 (it comes back as fp32)."""
    model = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=2)
    ids = next(lk.data.batches(2, 32))
    for to in ("host", "bf16"):
        off = ActivationOffload(to, keep=model)
        with CountedHooks(off) as counted:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        t = counted.tally
        assert t["copied"] == off.packs + off.shared > 0 and t["unpacked"] == t["copied"]
        assert t["unpacked_bytes"] == off.bytes_in * (2 if to == "bf16" else 1)
        assert not off._packed, "its exit clears the offloader's sharing table"


def test_counted_hooks_see_that_save_on_cpu_copies_nothing_on_a_cpu():
    model = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=1)
    ids = next(lk.data.batches(2, 16))
    with CountedHooks(torch.autograd.graph.save_on_cpu(), weights=model.parameters()) as counted:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counted.tally["saved"] > 0 and counted.tally["copied"] == 0


def test_grad_weight_copies_and_numpy_bytes_see_host_adam_move_its_state():
    layer = torch.nn.Linear(32, 32)
    opt = HostAdam(layer.parameters(), lr=1e-3)
    tracemalloc.start()
    try:
        with GradWeightCopies(layer) as moved:
            layer(torch.randn(4, 32)).sum().backward()
            opt.step()
        held = copies.numpy_bytes()
    finally:
        tracemalloc.stop()
    weights = sum(p.nbytes for p in layer.parameters())
    assert moved.from_grads == moved.into_weights == weights
    assert held >= 3 * weights                     # master copy and two moments, numpy on the host
    assert copies.numpy_bytes() == 0              # not tracing: nothing seen


def test_bf16_rounding_error_reaches_2_to_the_minus_8_not_minus_9():
    """Round to nearest with 8 significant bits: the relative error reaches 2^-8 (bf16's unit roundoff),
    so notebook 04's bound is 2^-8; with 2^-9 its assert fails."""
    values = torch.randn(2**20, generator=torch.Generator().manual_seed(0))
    rounding = ((values.bfloat16().float() - values).abs() / values.abs()).max().item()
    assert 2**-9 < rounding <= 2**-8
    assert not rounding <= 2**-9
    assert "2**-9 < rounding <= 2**-8" in cell("04_cpu_offload.ipynb", "rounding = ((values.bfloat16()")


@pytest.mark.parametrize("nb, solution, setup, check", [
    (NB02, "class MasterWeights:", SETUP02, CHECK02),
    (NB03, "def checkpoint_mlps(model):", SETUP03, CHECK03)], ids=["02-ex2", "03-ex2"])
def test_the_student_builds_stub_is_not_attempted(nb, solution, setup, check, capsys):
    """The student build's stub (solutions replaced by `raise NotImplementedError()`) reports "not attempted"."""
    from labkit.course import strip_solutions
    run(nb, setup, strip_solutions(cell(nb, solution)), check, ns03() if nb == NB03 else None)
    out = capsys.readouterr().out
    assert "Exercise 2 not attempted yet" in out and "passed" not in out
