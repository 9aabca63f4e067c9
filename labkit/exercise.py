"""Workshop helpers: checks that never hold the answer, and predict-then-measure.

An exercise is a function the learner completes. Its body sits between `### BEGIN SOLUTION` and
`### END SOLUTION`; the student build (`make student`, or nbgrader's `generate_assignment`) replaces that
block with `raise NotImplementedError()`, so a student notebook still runs from top to bottom. Its check
cell calls it inside `with lk.exercise(n, "what to do"):` and compares with a reference computed
elsewhere (labkit, or a hidden cell); a stub then prints "Exercise n not attempted yet: ..." instead of
failing. Under nbgrader's autograde (`NBGRADER_EXECUTION` set) a stub raises, so it earns no points.

    with lk.exercise(1, "write scale_loss() above"):
        got = scale_loss(...)
        lk.nontrivial(got, "scale_loss's result")
        assert torch.equal(got, reference)

Before a headline measurement, a cell asks for a prediction (a variable with a default, so CI runs);
`reveal()` then prints prediction, estimate and measurement side by side with each one's gap.
"""
import contextlib
import os

import torch

from .units import fmt_bytes, parse_bytes

__all__ = ["exercise", "nontrivial", "reveal"]


@contextlib.contextmanager
def exercise(number, task):
    """A check cell's body: passes, fails, or (on an untouched stub) says the exercise is not attempted."""
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"number must be a positive int, got {number!r}")
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"task must say what to do, got {task!r}")
    try:
        yield
    except NotImplementedError:
        if os.environ.get("NBGRADER_EXECUTION"):
            raise                                   # autograde: a stub earns no points
        print(f"Exercise {number} not attempted yet: {task}")
    else:
        print(f"Exercise {number}: passed")


def nontrivial(value, what="the answer"):
    """Rejects answers that pass a loose check by accident: None, NaN, or a tensor of zeros or one value."""
    if value is None:
        raise AssertionError(f"{what} is None: return the computed value")
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            raise AssertionError(f"{what} is empty")
        v = value.detach().float()
        if not torch.isfinite(v).all():
            raise AssertionError(f"{what} has NaN or infinite entries")
        if value.numel() > 1 and bool((v == v.flatten()[0]).all()):
            raise AssertionError(f"{what} holds one value everywhere ({v.flatten()[0].item():g}): not a real result")
    elif isinstance(value, (int, float)) and (value != value):
        raise AssertionError(f"{what} is NaN")
    return value


def _as_number(value, unit, name):
    if value is None:
        return None
    if unit == "bytes":
        return parse_bytes(value, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def reveal(what, predicted, estimated, measured, unit="bytes"):
    """Prints a prediction, an estimate and a measurement side by side; returns their gaps to the measurement.

    `predicted` may be None (not made), a number, or for bytes a string such as "120 MiB".
    `estimated` may be None where there is no formula.
    """
    measured_v = _as_number(measured, unit, "measured")
    if measured_v is None or measured_v <= 0:
        raise ValueError(f"measured must be a positive {unit}, got {measured!r}")
    show = fmt_bytes if unit == "bytes" else (lambda v: f"{v:,.4g} {unit}")
    rows, gaps = [("your prediction", predicted), ("estimate", estimated), ("measured", measured)], {}
    print(what)
    for label, value in rows:
        v = _as_number(value, unit, label.split()[-1])
        if v is None:
            print(f"  {label:<16} -")
            continue
        gap = v / measured_v - 1
        gaps[label.split()[-1]] = gap
        note = "" if label == "measured" else f"  ({gap:+.0%} vs measured)"
        print(f"  {label:<16} {show(v):>12}{note}")
    return gaps
