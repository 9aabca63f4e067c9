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

`forbid=` names the code the exercise teaches (functions, classes, modules): while the check runs, a
profile hook watches every call, so an answer that calls into it (imported, aliased, held in a default
argument or a global) fails with the name it called, however it got there. Compute references before the
`with` block: inside it, nothing forbidden may run.

    with lk.exercise(2, "write shard() above", forbid=[labkit.zero]):
        assert torch.equal(shard(flat, rank=1, world=2), want)

Before a headline measurement, a cell asks for a prediction (a variable that is None until the learner
sets it, so CI runs and nobody is handed an answer); `reveal()` then prints prediction, estimate and
measurement side by side with each one's gap, and says so when no prediction was made.
"""
import contextlib
import inspect
import math
import numbers
import os
import sys
import types

import numpy as np
import torch

from .units import fmt_bytes, parse_bytes

__all__ = ["exercise", "nontrivial", "reveal"]


def _name(obj):
    module = getattr(obj, "__module__", None) or ""
    return f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}".lstrip(".")


def _functions(obj, seen):
    """(function-like object, name) for everything `obj` stands for: itself, a class's methods, a module's code."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        for value in list(vars(obj).values()):
            if getattr(value, "__module__", None) == obj.__name__ and (inspect.isclass(value) or callable(value)):
                yield from _functions(value, seen)
    elif inspect.isclass(obj):
        for value in list(vars(obj).values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            if inspect.isfunction(value) or inspect.isbuiltin(value):
                yield from _functions(value, seen)
    elif inspect.ismethod(obj):
        yield from _functions(obj.__func__, seen)
    elif isinstance(obj, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        yield from _aten(obj)
    elif inspect.isfunction(obj) or inspect.isbuiltin(obj) or isinstance(obj, types.MethodDescriptorType):
        yield inspect.unwrap(obj), _name(obj)
        if inspect.isbuiltin(obj) and (getattr(obj, "__module__", None) or "").startswith("torch"):
            packet = getattr(torch.ops.aten, obj.__name__, None) if hasattr(torch.ops.aten, obj.__name__) else None
            if packet is not None:
                yield from _aten(packet)          # the same op reached as torch.ops.aten.<name>(.overload)
    else:
        raise TypeError(f"forbid must hold functions, classes or modules (the code the exercise teaches), "
                        f"got {obj!r}" + (": pass the object itself, not its name" if isinstance(obj, str) else ""))


def _aten(op):
    """The C functions behind an aten operator (every overload of a packet) and its torch.<name> twin."""
    packet = op.overloadpacket if isinstance(op, torch._ops.OpOverload) else op
    name = packet._qualified_op_name.split("::")[-1]
    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(packet, o) for o in packet.overloads()]
    for fn in [packet._op] + [o._op for o in overloads]:
        yield fn, f"torch.ops.aten.{name}"
    twin = getattr(torch, name, None)
    if inspect.isbuiltin(twin):
        yield twin, f"torch.{name}"


class _Watch:
    """A profile hook that notes the first call into forbidden code (Python functions by their code object,
    builtins such as torch's C functions by identity or name)."""

    def __init__(self, forbid):
        if isinstance(forbid, (str, bytes)) or not isinstance(forbid, (list, tuple, set, frozenset)):
            raise TypeError(f"forbid must be a list of functions, classes or modules, got {forbid!r}")
        self.codes, self.builtins, self.keep, seen = {}, {}, [], set()
        for item in forbid:
            for fn, name in _functions(item, seen):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    self.codes[code] = name
                else:
                    if fn.__name__:                  # an overload's C function is nameless: identity only
                        self.builtins[(getattr(fn, "__module__", None), fn.__name__)] = name
                    self.builtins[id(fn)] = name
                    self.keep.append(fn)             # ids stay valid while the watch lives
        self.called = None

    def __call__(self, frame, event, arg):
        if self.called is None:
            if event == "call":
                self.called = self.codes.get(frame.f_code)
            elif event == "c_call" and self.builtins:
                self.called = self.builtins.get(id(arg)) or self.builtins.get(
                    (getattr(arg, "__module__", None), getattr(arg, "__name__", None)))
        if self.previous is not None:
            self.previous(frame, event, arg)

    @contextlib.contextmanager
    def watching(self):
        if not self.codes and not self.builtins:
            yield
            return
        self.previous = sys.getprofile()
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(self.previous)


@contextlib.contextmanager
def exercise(number, task, forbid=()):
    """A check cell's body: passes, fails, or (on an untouched stub) says the exercise is not attempted.

    forbid: the functions, classes or modules the exercise teaches; a call into any of them while the
    block runs fails the check, naming what was called (compute references before the block).
    """
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"number must be a positive int, got {number!r}")
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"task must say what to do, got {task!r}")
    watch = _Watch(list(forbid) if isinstance(forbid, (tuple, set, frozenset)) else forbid)
    try:
        with watch.watching():
            yield
    except NotImplementedError as e:
        if e.args:            # not the stub's bare `raise NotImplementedError()`: e.g. nn.Module without forward
            raise AssertionError(f"Exercise {number}: {type(e).__name__}: {e} (is a method misspelt or missing?)") from e
        if os.environ.get("NBGRADER_EXECUTION"):
            raise                                   # autograde: a stub earns no points
        print(f"Exercise {number} not attempted yet: {task}")
        return
    except BaseException:
        if watch.called:
            raise AssertionError(f"Exercise {number}: your answer calls {watch.called}, the code this exercise "
                                 f"asks you to write yourself") from None
        raise
    if watch.called:
        raise AssertionError(f"Exercise {number}: your answer calls {watch.called}, the code this exercise "
                             "asks you to write yourself")
    print(f"Exercise {number}: passed")


def _constant(values, what):
    if values.size == 0:
        raise AssertionError(f"{what} is empty")
    if not np.isfinite(values).all():
        raise AssertionError(f"{what} has NaN or infinite entries")
    if values.size > 1 and bool((values == values.flat[0]).all()):
        raise AssertionError(f"{what} holds one value everywhere ({values.flat[0]:g}): not a real result")


def nontrivial(value, what="the answer"):
    """Rejects answers that pass a loose check by accident: None, NaN or infinity, or an array of one value."""
    if value is None:
        raise AssertionError(f"{what} is None: return the computed value")
    if isinstance(value, torch.Tensor):
        if value.is_meta or value.is_complex():
            raise AssertionError(f"{what} is a {'meta' if value.is_meta else 'complex'} tensor: return real values")
        _constant(value.detach().double().cpu().numpy(), what)
    elif isinstance(value, np.ndarray):
        _constant(np.asarray(value, dtype=np.float64), what)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(float(value)):
        raise AssertionError(f"{what} is {float(value)}: not a real result")
    return value


def _as_number(value, unit, name):
    if value is None:
        return None
    if isinstance(value, np.generic):
        value = value.item()
    if unit == "bytes":
        return parse_bytes(value, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number of {unit}, got {value!r}")
    return float(value)


def reveal(what, predicted, estimated, measured, unit="bytes"):
    """Prints a prediction, an estimate and a measurement side by side; returns their gaps to the measurement.

    `predicted` is None until the learner makes one (then it says so), a number, or for bytes a string
    such as "120 MiB". `estimated` may be None where there is no formula.
    """
    if not isinstance(unit, str) or not unit.strip():
        raise ValueError(f"unit must be a non-empty string such as 'bytes' or 'ms', got {unit!r}")
    measured_v = _as_number(measured, unit, "measured")
    if measured_v is None or measured_v <= 0:
        raise ValueError(f"measured must be a positive {unit}, got {measured!r}")
    values = {"prediction": _as_number(predicted, unit, "predicted"),
              "estimate": _as_number(estimated, unit, "estimated"), "measured": measured_v}
    show = fmt_bytes if unit == "bytes" else (lambda v: f"{v:,.4g} {unit}")
    gaps = {}
    print(what)
    for label, v in values.items():
        title = "your prediction" if label == "prediction" else label
        if v is None:
            print(f"  {title:<16} " + ("- (not predicted: set the PREDICT_ value above and run again)"
                                       if label == "prediction" else "-"))
            continue
        gaps[label] = v / measured_v - 1
        note = "" if label == "measured" else f"  ({v / measured_v - 1:+.0%} vs measured)"
        print(f"  {title:<16} {show(v):>12}{note}")
    return gaps
