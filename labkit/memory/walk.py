"""What tensors an object holds: the walk that `track()`, `oom_guard()` and `estimate` share.

`tensors(obj)` finds every tensor in a module, an optimizer, a container or an object with tensor
attributes (a transformers Cache); `objects(objs, fn)` reads the arguments of `track()`/`oom_guard()`
once, so that a one-shot iterator (`model.parameters()`) is not found empty when walked again;
`frame_locals(frame)` reads a running function's variables (what `oom_guard` and `leaks` name) without
leaving Python's snapshot of them, which would keep every tensor they name alive.
"""
from __future__ import annotations

import collections.abc
import inspect

import torch

__all__ = ["tensors", "objects", "saved_for_backward", "frame_locals"]


def objects(objs, fn):
    """objs as given, with each one-shot iterator (`model.parameters()`, a generator, `map`) read into a
    list once: walked later, it would be empty and the tracker or guard would silently see nothing.
    fn: the name of the caller, for the error message ("track", "oom_guard")."""
    out = []
    for n, obj in enumerate(objs):
        if isinstance(obj, (str, bytes, int, float, complex)) or obj is None:
            raise TypeError(f"{fn}() takes modules, optimizers, tensors or iterables of them; argument {n} "
                            f"is {type(obj).__name__} {obj!r}")
        one_shot = hasattr(obj, "__next__") and iter(obj) is obj
        if not isinstance(obj, torch.Tensor) and (one_shot or isinstance(obj, collections.abc.ValuesView)):
            items = list(obj)
            bad = [type(t).__name__ for t in items if not isinstance(t, (torch.Tensor, torch.nn.Module, list, tuple))]
            if bad:
                raise TypeError(f"{fn}() argument {n} is an iterator of {bad[0]}, expected tensors or modules "
                                f"(like model.parameters())")
            obj = items
        out.append(obj)
    return tuple(out)


def tensors(obj, _seen=None):
    """Every tensor reachable in obj: tensors, modules, optimizers, containers, objects with tensors."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        yield from tensors(obj.state, seen)
    elif isinstance(obj, dict) or hasattr(obj, "items") and callable(obj.items):
        for v in obj.values():
            yield from tensors(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from tensors(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):   # e.g. a transformers Cache
        for v in vars(obj).values():
            if isinstance(v, (torch.Tensor, list, tuple, dict)) or hasattr(v, "__dict__"):
                yield from tensors(v, seen)


def saved_for_backward(cache):
    """A cache filled by a forward that records a graph (training with `use_cache` left on): its K and V are
    what attention saved for backward, so they stay activations, as lk.estimate counts them. A cache is
    "kv_cache" only when it is kept for later tokens without a graph (generate, inference)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors(cache))


def frame_locals(frame):
    """{name: value} of the variables of a running frame, as a copy that the frame does not keep.

    On Python < 3.13 a function's `f_locals` is a snapshot dict cached on the frame: it holds every value it
    saw until the frame ends, even after a `del` in the function (the oom_guard's advice) or a rebinding. The
    copy is taken and the snapshot emptied; Python refills it on the next read (a debugger's trace hook reads
    it afresh before each event). A `locals()` dict taken earlier in that function is the same dict: it is
    emptied too. A module's or a notebook's frame holds its globals, not a snapshot: left as it is.
    """
    scope = frame.f_locals
    names = dict(scope)
    if type(scope) is dict and frame.f_code.co_flags & inspect.CO_OPTIMIZED:   # 3.13+: a proxy, no snapshot
        scope.clear()
    return names
