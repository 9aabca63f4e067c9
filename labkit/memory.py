"""Count live tensor memory by category, on any device, also under FakeTensorMode and on meta.

`track()` sees every tensor an op creates (a `TorchDispatchMode`), counts its storage once (views
share storage), and subtracts it when the storage dies (a `weakref.finalize`). Every allocation and
free is an event; the timeline is rebuilt from the events with each storage's *final* category, so a
tensor born in backward that ends up as `param.grad` is a gradient for its whole life.
On CUDA the allocator's own peak (`torch.cuda.max_memory_allocated`) is read as well.
"""
from __future__ import annotations

import itertools
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .units import fmt_bytes, parse_bytes

__all__ = ["CATEGORIES", "track", "Tracker"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other")


def track(*objs, budget=None, device=None, snapshot=None):
    """Context manager: peak and timeline of live tensor bytes, by category.

    objs: modules, optimizers, tensors (or lists/dicts of them) that already exist; their memory is
    counted from the start and gives the categories (a module's parameters and grads, an optimizer's
    state). Tensors made inside the block are counted as they are created.
    budget: bytes or "2 GiB"; past it an op raises `torch.OutOfMemoryError` (what `lk.budget` uses).
    device: count only tensors on this device type ("cpu", "cuda", "meta"); default: all.
    snapshot: on CUDA, a file to write the allocator's memory snapshot to (open it with
    https://pytorch.org/memory_viz); ignored elsewhere.
    """
    return Tracker(*objs, budget=budget, device=device, snapshot=snapshot)


class Tracker(TorchDispatchMode):
    """The report of `track()`: `peak`, `peak_parts`, `max_parts`, `timeline`, `live`, `marks`."""

    def __init__(self, *objs, budget=None, device=None, snapshot=None):
        super().__init__()
        self.snapshot = snapshot
        self.budget = None if budget is None else parse_bytes(budget, "budget")
        kind = str(device).split(":")[0] if device is not None else None
        if kind not in (None, "cpu", "cuda", "meta", "mps", "xpu"):
            raise ValueError(f"device must be a device type like 'cpu', 'cuda' or 'meta', got {device!r}")
        self.device = kind
        self._objs = objs
        self._serial = itertools.count()
        self._live = {}        # id(storage) -> [serial, nbytes, finalizer]
        self._label = {}       # serial -> category (the latest wins, for the whole lifetime)
        self._events = []      # (serial, +/-bytes)
        self.marks = []        # (event index, text)
        self._phase = ["other"]
        self._hooks = []
        self.live = self.peak = 0
        self.cuda = None

    # ---- counting -------------------------------------------------------------------------
    def _see(self, t, category=None):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        if self.device is not None and t.device.type != self.device:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # tensors without storage (some subclasses)
            return
        nbytes = st.nbytes()
        entry = self._live.get(id(st))
        if entry is None:
            serial = next(self._serial)
            fin = weakref.finalize(st, self._free, id(st))
            self._live[id(st)] = [serial, nbytes, fin]
            self._label[serial] = category or self._phase[-1]
            self._change(serial, nbytes, t)
        else:
            if category is not None:
                self._label[entry[0]] = category
            if nbytes != entry[1]:                     # resized in place (resize_, out=)
                delta, entry[1] = nbytes - entry[1], nbytes
                self._change(entry[0], delta, t)

    def _change(self, serial, delta, t=None):
        self._events.append((serial, delta))
        self.live += delta
        self.peak = max(self.peak, self.live)
        if self.budget is not None and delta > 0 and self.live > self.budget:
            live = self.live
            raise torch.OutOfMemoryError(
                f"budget {fmt_bytes(self.budget)} exceeded: live {fmt_bytes(live)} after allocating "
                f"{fmt_bytes(delta)} ({tuple(t.shape) if t is not None else ''} {getattr(t, 'dtype', '')})"
            )

    def _free(self, key):
        entry = self._live.pop(key, None)
        if entry is not None:
            self._change(entry[0], -entry[1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place op) allocated nothing, even if
        # that storage was born before tracking began and is seen here for the first time.
        inputs = {_storage_id(t) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            key = _storage_id(t)
            if key is not None and (key not in inputs or key in self._live):
                self._see(t)
        return out

    # ---- categories -----------------------------------------------------------------------
    def label(self, obj, category):
        """Count every tensor in `obj` (tensor, module, optimizer, list/dict, HF cache) as `category`."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        for t in _tensors(obj):
            self._see(t, category)

    def mark(self, text):
        """Put a named mark on the timeline at this moment."""
        self.marks.append((len(self._events), str(text)))

    def _register(self, obj):
        if isinstance(obj, torch.nn.Module):
            self.label(list(obj.parameters()) + list(obj.buffers()), "parameters")
            self.label([p.grad for p in obj.parameters() if p.grad is not None], "gradients")
            self._hooks.append(obj.register_forward_pre_hook(lambda *a: self.mark("forward")))
            self._hooks.append(obj.register_forward_hook(self._forward_post))
            for p in obj.parameters():
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda p: self._see(p.grad, "gradients")))
        elif isinstance(obj, torch.optim.Optimizer):
            self.label([p for g in obj.param_groups for p in g["params"]], "parameters")
            self.label(obj.state, "optimizer")
            self._hooks.append(obj.register_step_pre_hook(lambda *a: self._enter_phase("other", "step")))
            self._hooks.append(obj.register_step_post_hook(lambda o, *a: self._step_done(o)))
        else:
            self.label(obj, "other")

    def _enter_phase(self, category, text):
        self._phase.append(category)
        self.mark(text)

    # Whatever any module's forward creates is an activation: also the forward that activation
    # checkpointing re-runs during backward. Global hooks, so that submodules count too.
    def _module_pre(self, module, args):
        self._phase.append("activations")

    def _module_post(self, module, args, out):
        self._phase.pop()

    def _forward_post(self, module, args, out):
        self.mark("forward end")
        if isinstance(out, dict):            # transformers' ModelOutput: its KV cache is a cache
            for key in ("cache", "past_key_values"):
                if out.get(key) is not None:
                    self.label(out[key], "kv_cache")
        first = next((t for t in _tensors(out) if t.requires_grad), None)
        if first is not None and torch.is_grad_enabled():
            first.register_hook(lambda g: self.mark("backward"))

    def _step_done(self, optimizer):
        self._phase.pop()
        self.label(optimizer.state, "optimizer")
        self.mark("step end")

    # ---- context --------------------------------------------------------------------------
    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda = {"allocated_start": torch.cuda.memory_allocated()}
            if self.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        self._hooks.append(register_module_forward_pre_hook(self._module_pre))
        self._hooks.append(register_module_forward_hook(self._module_post, always_call=True))
        for obj in self._objs:
            self._register(obj)
        self.start = self.live
        self.mark("start")
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for h in self._hooks:
            h.remove()
        self.mark("end")
        if self.cuda is not None:
            torch.cuda.synchronize()
            self.cuda.update(peak_allocated=torch.cuda.max_memory_allocated(),
                             peak_reserved=torch.cuda.max_memory_reserved())
            if self.snapshot:
                torch.cuda.memory._dump_snapshot(str(self.snapshot))
                torch.cuda.memory._record_memory_history(enabled=None)
        # Stop counting frees after the block, but keep what we measured.
        for _, _, fin in self._live.values():
            fin.detach()
        return False

    # ---- the report -----------------------------------------------------------------------
    @property
    def timeline(self):
        """Bytes per category after every event: {category: array}, plus "total"."""
        cat_index = {c: i for i, c in enumerate(CATEGORIES)}
        deltas = np.zeros((len(self._events) + 1, len(CATEGORIES)), dtype=np.int64)
        for i, (serial, delta) in enumerate(self._events, start=1):
            deltas[i, cat_index[self._label[serial]]] = delta
        sums = np.cumsum(deltas, axis=0)
        out = {c: sums[:, i] for c, i in cat_index.items()}
        out["total"] = sums.sum(axis=1)
        return out

    @property
    def peak_parts(self):
        """The breakdown by category at the moment of the peak."""
        tl = self.timeline
        i = int(np.argmax(tl["total"]))
        return {c: int(tl[c][i]) for c in CATEGORIES}

    @property
    def max_parts(self):
        """Each category's own maximum over the block (they need not coincide)."""
        tl = self.timeline
        return {c: int(tl[c].max()) for c in CATEGORIES}

    def at(self, mark):
        """The breakdown by category at the last mark named `mark` (e.g. "forward end")."""
        found = [i for i, text in self.marks if text == mark]
        if not found:
            raise ValueError(f"mark must be one of {sorted({t for _, t in self.marks})}, got {mark!r}")
        tl = self.timeline
        return {c: int(tl[c][found[-1]]) for c in CATEGORIES}

    def __repr__(self):
        parts = ", ".join(f"{c} {fmt_bytes(b)}" for c, b in self.peak_parts.items() if b)
        return f"<track peak {fmt_bytes(self.peak)} ({parts}); live {fmt_bytes(self.live)}>"


def _storage_id(t):
    """id of a strided tensor's storage object (the same object while the storage lives), else None."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return None
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(obj, _seen=None):
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
        yield from _tensors(obj.state, seen)
    elif isinstance(obj, dict) or hasattr(obj, "items") and callable(obj.items):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):   # e.g. a transformers Cache
        for v in vars(obj).values():
            if isinstance(v, (torch.Tensor, list, tuple, dict)) or hasattr(v, "__dict__"):
                yield from _tensors(v, seen)
