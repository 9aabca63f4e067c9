"""The estimate by measurement, for what no formula covers (est.method == "fake"): the model is built on
FakeTensorMode (shapes, no data) and `track()` follows a real step of it (step.py): the step of a plain
training loop, `model(input_ids=ids, labels=ids).loss.backward()`, use_cache left at the config's default.

Exact to the byte only where a test shows it: a grouped-KV decoder (Qwen3) training in fp32 at 64 and 2048
tokens (tests/test_estimate_families.py; the first step within AdamW's 4-byte step counters); GPT-NeoX, Phi3
(fused QKV: the training forward's cache keeps 2 and 1.5 x b*s*h per layer less than use_cache=False) and
BART against a plain loop (tests/test_estimate_families.py). Elsewhere it is what the same step allocates
on a CPU, not what CUDA kernels would.
"""
from __future__ import annotations

import contextlib

from ..units import fmt_bytes
from .config import build_model
from .formulas import CATS, Estimate, states
from .step import measure_step

__all__ = ["fake_estimate", "add_states_by_formula", "fake_friendly_moe", "from_trackers", "phase_of"]


def fake_estimate(config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach, logits_to_keep,
                  grad_accum):
    """The estimate by measurement: a real step of the model on FakeTensorMode tensors, followed by track()."""
    import torch
    if optimizer == "adamw-8bit":
        raise ValueError(f"no fake-tensor measurement for optimizer {optimizer!r} (model_type "
                         f"{config.model_type!r} has no formula); use 'adamw' or a family with a formula")
    if dtype == "mixed" and optimizer not in ("adam", "adamw", None, "sgd", "sgd-momentum"):
        raise ValueError(f"no fake-tensor measurement for dtype 'mixed' with optimizer {optimizer!r}")
    if recompute not in (False, True):
        raise ValueError(f"recompute={recompute!r} has no fake-tensor measurement; use True or False "
                         f"(model_type {config.model_type!r} has no formula)")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "mixed": torch.bfloat16}.get(dtype, torch.float32)
    model = build_model(config, "fake", torch_dtype)
    from torch._subclasses.fake_tensor import DataDependentOutputException
    try:
        with fake_friendly_moe():
            first, mem = measure_step(model, config, batch, seq, "bf16" if dtype == "mixed" else dtype, optimizer,
                                      training, recompute, kv_tokens, foreach, logits_to_keep)
    except DataDependentOutputException as e:     # e.g. BART's LayerDrop test on a random number, transformers < 5.24
        import transformers
        raise RuntimeError(f"model_type {config.model_type!r}: transformers {transformers.__version__} reads a "
                           f"tensor's value in Python during this step ({e}); fake tensors have none, so the fake "
                           "path cannot measure it here (the lock's transformers can)") from e
    est = from_trackers(model, config, first, mem)
    est.largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    if training:
        add_states_by_formula(est, dtype, optimizer, grad_accum)
    return est


def add_states_by_formula(est, dtype, optimizer, grad_accum):
    """What the fake step cannot run, added to a measured training step by formula: dtype="mixed" (measured
    in bf16; its optimizer state becomes fp32 master weights + fp32 state, `states`) and grad_accum's fp32
    buffer (4 bytes/param, alive through every moment of every step)."""
    P = est.params
    extra_opt = states(P, dtype, optimizer, False)[2] - states(P, "bf16", optimizer, False)[2] if dtype == "mixed" else 0
    extra_grad = 4 * P if grad_accum else 0
    if not (extra_opt or extra_grad):
        return
    est.parts["optimizer"] += extra_opt
    est.parts["gradients"] += extra_grad
    est.peak_parts["gradients"] += extra_grad
    est.peak_parts["optimizer"] += extra_opt     # the steady peak holds the state
    est.steady += extra_opt + extra_grad
    est.first_step += extra_grad + (extra_opt if est.phase == "optimizer step" else 0)
    est.total = max(est.first_step, est.steady)
    est.notes.append("added by formula to the measured step: " + ", ".join(
        x for x in (f"fp32 master weights and state for 'mixed' (+{fmt_bytes(extra_opt)})" if extra_opt else "",
                    f"grad_accum's fp32 buffer (+{fmt_bytes(extra_grad)})" if extra_grad else "") if x))


@contextlib.contextmanager
def _patched(module_name, attr, replacement):
    """module.attr replaced while the block runs (nothing done if the module or the name does not exist)."""
    import importlib
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    if module is None or not hasattr(module, attr):
        yield
        return
    old = getattr(module, attr)
    setattr(module, attr, replacement)
    try:
        yield
    finally:
        setattr(module, attr, old)


@contextlib.contextmanager
def fake_friendly_moe():
    """What a fake step must not inherit from transformers' checks for tracing (is_tracing() is True on a
    FakeTensor), each patched only while measuring:
    - MoE experts call torch's grouped_mm, whose fake kernel accepts bf16 only; transformers' own fallback
      op (same output, same saved tensors) has a fake kernel for every dtype: use it. Before transformers 5.24
      its backward read the experts' token offsets with .tolist() (no fake tensor can answer): on those versions
      a backward that allocates the same two gradients is registered for fake tensors (real ones: unchanged).
    - masking_utils.find_packed_sequence_indices cannot read the position ids of a fake tensor, so it
      assumes packed sequences: every layer then gets a (b, 1, s, s) mask and SDPA K/V expanded to all
      heads, which a real step with one sequence per row never has. Our step packs nothing: say so (None).
    - masking_utils cannot read a fake padding mask either, so it never lets SDPA skip the causal or
      bidirectional mask: a model that makes an all-ones mask itself when given none (BART's decoder and
      17 other families) got a (b, 1, s, s) mask in fp32 per layer that a real step skips (+2·b·s²·4 B
      for BART's two decoder layers). Our step pads nothing: the mask is all ones, say so (no mask).
    """
    _fake_safe_moe_backward()
    with _patched("transformers.integrations.moe", "_can_use_grouped_mm", _no_grouped_mm), \
            _patched("transformers.masking_utils", "find_packed_sequence_indices", _no_packed_sequences), \
            _patched_keeping("transformers.masking_utils", "_ignore_causal_mask_sdpa", _no_padding), \
            _patched_keeping("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa", _no_padding):
        yield


@contextlib.contextmanager
def _patched_keeping(module_name, attr, wrapper):
    """module.attr replaced by `wrapper(original)` while the block runs (nothing done if it does not exist)."""
    import importlib
    try:
        original = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError):
        yield
        return
    with _patched(module_name, attr, wrapper(original)):
        yield


def _no_padding(original):
    """transformers' check whether SDPA may skip a mask, told that a fake padding mask is all ones (None)."""
    import torch

    def check(padding_mask, *args, **kwargs):
        if isinstance(padding_mask, torch.Tensor) and _is_fake(padding_mask):
            padding_mask = None
        return original(padding_mask, *args, **kwargs)
    return check


def _is_fake(t):
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


_MOE_BACKWARD = []


def _fake_safe_moe_backward():
    """On transformers < 5.24 (no fake kernel for the grouped-mm fallback's backward): register, once, a backward
    that gives fake tensors the zeros_like(input) and zeros_like(weight) the real one allocates, and calls the
    real one for real tensors."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        return
    if _MOE_BACKWARD or hasattr(moe, "_grouped_mm_fallback_backward_fake") or \
            not hasattr(moe, "_grouped_mm_fallback_backward"):
        return
    import torch
    real = moe._grouped_mm_fallback_backward

    def backward(ctx, grad_output):
        if _is_fake(ctx.offs):
            input, weight = ctx.saved_tensors
            return torch.zeros_like(input), torch.zeros_like(weight), None
        return real(ctx, grad_output)
    torch.library.register_autograd("transformers::grouped_mm_fallback", backward,
                                    setup_context=moe._grouped_mm_fallback_setup_context)
    _MOE_BACKWARD.append(backward)


def _no_grouped_mm(*args, **kwargs):
    """transformers' _can_use_grouped_mm, answering no: the experts run its fallback op."""
    return False


def _no_packed_sequences(position_ids):
    """transformers' find_packed_sequence_indices, answering: nothing is packed."""
    return None


def from_trackers(model, config, first, mem):
    """An Estimate from the trackers of a measured first and later step."""
    parts = dict(mem.max_parts)
    if any(t == "forward end" for _, t in mem.marks) and mem.max_parts["optimizer"] + mem.max_parts["gradients"]:
        parts["activations"] = mem.at("forward end")["activations"]    # what the formulas call activations
    peak = mem.peak_parts
    parts["other"] = peak["other"]
    notes = [f"measured on fake tensors: {config.model_type} has no formula here"]
    total, phase = mem.peak, phase_of(mem)
    if not (mem.max_parts["optimizer"] + mem.max_parts["gradients"]):
        parts["kv_cache"] = mem.at("end")["kv_cache"]          # the cache that stays, as the formulas count it
        left, growth = getattr(mem, "unrun", (0, 0))
        if left:                 # the first decoding steps were run; the rest add `growth` bytes of cache each
            import numpy as np
            tl = mem.timeline
            start = next(i for i, t in mem.marks if t == "decode")
            i = start + int(np.argmax(tl["total"][start:]))
            decode = {c: int(tl[c][i]) for c in CATS}
            decode["kv_cache"] += left * growth
            parts["kv_cache"] += left * growth
            if sum(decode.values()) > total:
                total, peak, phase = sum(decode.values()), decode, "decode"
            notes.append(f"the last {left} decoding steps extrapolated: +{fmt_bytes(growth)} of cache each")
    P = sum(p.numel() for p in model.parameters())
    total = max(total, first.peak) if first is not mem else total
    return Estimate(parts=parts, total=total, peak_parts=peak, params=P, method="fake",
                    phase=phase, first_step=first.peak if first is not mem else total,
                    steady=mem.peak if first is not mem else total, notes=notes)


def phase_of(mem):
    """The name of the moment holding the peak, from the tracker's marks."""
    import numpy as np
    i = int(np.argmax(mem.timeline["total"]))
    before = [t for j, t in mem.marks if j <= i]
    if "step" in before and "step end" not in before[before.index("step"):]:
        return "optimizer step"
    for mark, phase in (("decode", "decode"), ("prefill", "prefill"), ("backward", "start of backward"),
                        ("forward end", "loss"), ("forward", "forward")):
        if mark in before:
            if phase == "start of backward" and [t for t in before if t == "forward"][1:]:
                return "recomputation"
            return phase
    return "start"

