"""Workshop helpers: exercise checks that catch mistakes and shortcuts, and predict-then-measure.

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
argument or a global, an exec'd copy of its source under the same name, a thread it starts) fails with
the name it called. Compute references before the `with` block: inside it, nothing forbidden may run.

    with lk.exercise(2, "write shard() above", forbid=[labkit.zero]):
        assert torch.equal(shard(flat, rank=1, world=2), want)

What a check is for (the threat model). A check catches mistakes and shortcuts: a wrong or trivial
answer, a constant or a number typed in where the exercise asks for a measurement (try more than one
input, and measure something the answer must have done), the unsharded or uncheckpointed computation,
a call into the code being taught. It runs in the learner's own process, with the learner's code, so it
cannot stop deliberate introspection: reading the check's reference from a global or from the check's
own frame (`sys._getframe`, a comprehension's variables), finding an object through `gc`, a renamed copy
of labkit's code, work hidden in a forked child process. Keeping references local, or computing the
answer first, does not change that; no check in this workbook claims otherwise, and none adds machinery
against it. Grading for credit uses nbgrader's autograde with hidden tests, which the learner never
sees (docs/instructor.md).

Before a headline measurement, a cell asks for a prediction (a variable that is None until the learner
sets it, so CI runs and nobody is handed an answer); `reveal()` then prints prediction, estimate and
measurement side by side with each one's gap, and says so when no prediction was made.
"""
import contextlib
import inspect
import math
import numbers
import os
import re
import sys
import threading
import types

import numpy as np
import torch
import torch.overrides

from .checks import count
from .units import fmt_bytes, parse_bytes

__all__ = ["exercise", "nontrivial", "reveal"]


def _name(obj):
    module = getattr(obj, "__module__", None) or ""
    return f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', repr(obj)))}".lstrip(".")


def _functions(obj, seen):
    """(function-like object, name) for everything `obj` stands for: itself, a class's methods, a module's code;
    not labkit's callbacks marked `runs_on_its_own` (a tracker's weakref callback runs when a storage it counted
    dies, inside any block: no answer calls it)."""
    if id(obj) in seen or getattr(obj, "runs_on_its_own", False):
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        for value in list(vars(obj).values()):
            value = inspect.unwrap(value) if callable(value) and hasattr(value, "__wrapped__") else value
            if getattr(value, "__module__", None) == obj.__name__ and (
                    inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value)):
                yield from _functions(value, seen)     # (other callables there, e.g. instances, are data)
        if hasattr(obj, "__path__"):                   # a package: its submodules' code too (labkit.memory)
            for name, sub in list(sys.modules.items()):
                if name.startswith(obj.__name__ + ".") and isinstance(sub, types.ModuleType):
                    yield from _functions(sub, seen)
    elif inspect.isclass(obj):
        for value in list(vars(obj).values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            defined_here = inspect.isfunction(value) and value.__qualname__.startswith(obj.__qualname__ + ".")
            c_method = isinstance(value, types.MethodDescriptorType) and value.__objclass__ is obj
            if defined_here or c_method:           # not what it inherits or holds (object.__new__ in an Enum)
                yield from _functions(value, seen)
    elif inspect.ismethod(obj):
        yield from _functions(obj.__func__, seen)
    elif isinstance(obj, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        yield from _aten(obj)
    elif callable(obj) and hasattr(obj, "__wrapped__"):           # functools.cache, wraps, ...
        yield from _functions(inspect.unwrap(obj), seen)
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
    namespace, _, name = packet._qualified_op_name.rpartition("::")
    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(packet, o) for o in packet.overloads()]
    for fn in [packet._op] + [o._op for o in overloads]:
        yield fn, f"torch.ops.{namespace}.{name}"     # torch.ops.aten.softmax, torch.ops.bitsandbytes.quantize_4bit
    twin = getattr(torch, name, None)
    if inspect.isbuiltin(twin):
        yield twin, f"torch.{name}"


def _shape_of(code):
    """What an exec'd copy of a function's source shares with it (its bytecode may differ: compile flags)."""
    return code.co_argcount, code.co_varnames, code.co_names, len(code.co_consts)


class _Watch:
    """A profile hook that notes the first call into forbidden code (Python functions by their code object,
    builtins such as torch's C functions by identity or name)."""

    def __init__(self, forbid):
        if isinstance(forbid, (str, bytes)) or not isinstance(forbid, (list, tuple, set, frozenset)):
            raise TypeError(f"forbid must be a list of functions, classes or modules, got {forbid!r}")
        self.codes, self.copies, self.builtins, self.torch_ops, self.keep, seen = {}, {}, {}, {}, [], set()
        for item in forbid:
            for fn, name in _functions(item, seen):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    self.codes[code] = name
                    self.copies.setdefault(code.co_name, {})[_shape_of(code)] = name
                else:
                    module = getattr(fn, "__module__", None)
                    if module and fn.__name__ and not fn.__name__.startswith("__"):   # else identity only:
                        self.builtins[(module, fn.__name__)] = name    # (None, "__new__") would be any object
                    self.builtins[id(fn)] = name
                    self.keep.append(fn)             # ids stay valid while the watch lives
                    tensor_method = isinstance(getattr(fn, "__objclass__", None), type) and issubclass(
                        fn.__objclass__, torch._C.TensorBase)            # torch.Tensor.softmax
                    if (module or "").startswith("torch") or name.startswith("torch.") or tensor_method:
                        # the same op reached from C (map, functools.partial, x @ y, x.softmax): by name
                        base = name.rsplit(".", 1)[-1]
                        for op in (base, base + "_"):
                            self.torch_ops.setdefault(op, name)
        self.called, self.closing = None, False

    def __call__(self, frame, event, arg):
        self.note(frame, event, arg)
        if self.previous is not None:
            self.previous(frame, event, arg)

    def note(self, frame, event, arg):
        if self.called is None:
            if event == "c_call" and arg in (sys.setprofile, threading.setprofile) and not self.closing:
                self.called = f"{arg.__module__ or 'sys'}.setprofile, which switches off this check's watch"
            elif event == "call":
                code = frame.f_code
                self.called = self.codes.get(code)
                copies = self.copies.get(code.co_name) if self.called is None else None
                if copies:                          # an exec'd copy of its source: a new code object, same code
                    self.called = copies.get(_shape_of(code))
            elif event == "c_call" and self.builtins:
                self.called = self.builtins.get(id(arg)) or self.builtins.get(
                    (getattr(arg, "__module__", None), getattr(arg, "__name__", None)))
                if self.called is None and isinstance(getattr(arg, "__self__", None), torch.Tensor):
                    self.called = self.torch_ops.get(arg.__name__)       # x.softmax(): a Tensor method

    def in_thread(self, frame, event, arg):
        """The hook of threads started inside the block (theirs to chain is threading's previous hook)."""
        self.note(frame, event, arg)
        if self.thread_previous is not None:
            self.thread_previous(frame, event, arg)

    @contextlib.contextmanager
    def watching(self):
        if not self.codes and not self.builtins:
            yield
            return
        self.previous, self.thread_previous = sys.getprofile(), threading.getprofile()
        with contextlib.ExitStack() as stack:
            # A CUDA backward runs on autograd's own C++ threads, which no profile hook reaches: keep it here.
            stack.enter_context(torch.autograd.set_multithreading_enabled(False))
            if self.torch_ops:
                stack.enter_context(_TorchOps(self))
            threading.setprofile(self.in_thread)  # threads the answer starts are watched too
            sys.setprofile(self)
            try:
                yield
            finally:
                self.closing = True                 # the watch's own setprofile calls below are no answer's
                sys.setprofile(self.previous)
                threading.setprofile(self.thread_previous)


class _TorchOps(torch.overrides.TorchFunctionMode):
    """Sees torch calls that no profile event reports (C calling C: map(torch.exp, ...), functools.partial,
    operators such as x @ y): each torch function or Tensor method by its name."""

    def __init__(self, watch):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.watch.called is None:
            self.watch.called = self.watch.torch_ops.get(getattr(func, "__name__", None))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def exercise(number, task, forbid=()):
    """A check cell's body: passes, fails, or (on an untouched stub) says the exercise is not attempted.

    forbid: the functions, classes or modules the exercise teaches; a call into any of them while the
    block runs fails the check, naming what was called (compute references before the block).
    """
    number = count("number", number)
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"task must say what to do, got {task!r}")
    watch = _Watch(list(forbid) if isinstance(forbid, (tuple, set, frozenset)) else forbid)
    try:
        with watch.watching():
            yield
    except NotImplementedError as e:
        if watch.called:       # a forbidden call first, then a stub or a missing method: the call is the news
            raise AssertionError(f"Exercise {number}: your answer calls {watch.called}, the code this exercise "
                                 f"asks you to write yourself") from None
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


def _real_array(value, what):
    """`value` (an array, or a list/tuple of numbers) as float64, or an AssertionError saying why it is none."""
    values = np.asarray(value)
    if values.dtype.kind == "c":
        raise AssertionError(f"{what} is a complex array: return real values")
    if values.dtype.kind not in "biuf":
        raise AssertionError(f"{what} is an array of {values.dtype} ({value!r:.80}), not of numbers")
    return values.astype(np.float64)


def nontrivial(value, what="the answer"):
    """Rejects answers that pass a loose check by accident: None, NaN or infinity, or an array of one value
    (a tensor or numpy array; a list or tuple of numbers is only checked for NaN and infinity)."""
    if not isinstance(what, str) or not what.strip():
        raise TypeError(f"what must say what the value is, like \"scale_loss's result\", got {what!r}")
    if value is None:
        raise AssertionError(f"{what} is None: return the computed value")
    if isinstance(value, torch.Tensor):
        if value.is_meta or value.is_complex():
            raise AssertionError(f"{what} is a {'meta' if value.is_meta else 'complex'} tensor: return real values")
        _constant(value.detach().double().cpu().numpy(), what)
    elif isinstance(value, np.ndarray):
        _constant(_real_array(value, what), what)
    elif isinstance(value, (list, tuple)) and value and all(
            isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) for v in value):
        if not np.isfinite(np.asarray(value, dtype=np.float64)).all():      # equal entries may be a real answer
            raise AssertionError(f"{what} has NaN or infinite entries")
    elif isinstance(value, numbers.Complex) and not isinstance(value, bool) and not np.isfinite(complex(value)):
        raise AssertionError(f"{what} is {value}: not a real result")
    return value


def _as_number(value, unit, name):
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()                      # torch.cuda.max_memory_allocated() is an int; a 0-d sum is not
    elif isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if unit == "bytes":
        return parse_bytes(value, name)
    if isinstance(value, str):                    # "12 ms" where the unit is ms
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*" + re.escape(unit.strip()) + r"?\s*", value)
        if not m:
            raise ValueError(f"{name} must be a number of {unit} or a string like '12 {unit.strip()}', got {value!r}")
        value = float(m.group(1))
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number of {unit}, got {value!r}")
    return float(value)


def _percent(gap):
    """A signed gap in whole percent, never "-0%": one that rounds to 0% gets two decimals, and "0.00%" no sign."""
    for digits in (0, 2):
        text = f"{gap:+.{digits}%}"
        if float(text[:-1]) != 0:
            return text
    return f"{0:.2%}"


def reveal(what, predicted, estimated, measured, unit="bytes", measured_label="measured"):
    """Prints a prediction, an estimate and a measurement side by side; returns their gaps to the measurement.

    `predicted` is None until the learner makes one (then it says so), a number, or for bytes a string
    such as "120 MiB". `estimated` may be None where there is no formula. `measured_label` names the third
    value where it is not a measurement of this machine (e.g. "modelled": a replay of a model); the gaps
    keep the key "measured".
    """
    if not isinstance(what, str) or not what.strip():
        raise ValueError(f"what must name the figure, like 'peak memory of one training step', got {what!r}")
    if not isinstance(unit, str) or not unit.strip():
        raise ValueError(f"unit must be a non-empty string such as 'bytes' or 'ms', got {unit!r}")
    if not isinstance(measured_label, str) or not measured_label.strip():
        raise ValueError(f"measured_label must be a non-empty string such as 'modelled', got {measured_label!r}")
    measured_v = _as_number(measured, unit, "measured")
    if measured_v is None or measured_v <= 0:
        raise ValueError(f"measured must be a positive {unit}, got {measured!r}")
    values = {"prediction": _as_number(predicted, unit, "predicted"),
              "estimate": _as_number(estimated, unit, "estimated"), "measured": measured_v}
    show = fmt_bytes if unit == "bytes" else (lambda v: f"{v:,.4g} {unit}")
    gaps = {}
    print(what)
    for label, v in values.items():
        title = {"prediction": "your prediction", "measured": measured_label}.get(label, label)
        if v is None:
            print(f"  {title:<16} " + ("- (not predicted: set the PREDICT_ value above and run again)"
                                       if label == "prediction" else "-"))
            continue
        gaps[label] = v / measured_v - 1
        note = "" if label == "measured" else f"  ({_percent(v / measured_v - 1)} vs {measured_label})"
        print(f"  {title:<16} {show(v):>12}{note}")
    return gaps
