"""`DispatchTracker`: `track()`'s default backend, counting storages op by op.

A `TorchDispatchMode` sees every tensor an op returns. Each new storage is counted once (views and
in-place ops share their input's storage) and subtracted when the storage dies (a weak reference's
callback). It needs no real memory, so it also counts under FakeTensorMode and on meta, and it can
stop the op that passes a budget (`lk.budget` on a CPU raises `torch.OutOfMemoryError` there).

What it cannot see: other threads (a dispatch mode is per thread; autograd's own threads inherit
it); `resize_` of a storage born before the block and not passed in (`UntypedStorage.resize_` is no
dispatched op: it is wrapped while a block runs, and only storages already counted can grow or
shrink in the books); compiled code (Dynamo will not run a compiled graph under a dispatch mode and
falls back to eager, so what would be counted is not what the compiled code allocates: a block in
which that happened raises, pointing to `backend="profiler"`).
"""
from __future__ import annotations

import functools
import logging
import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..units import fmt_bytes
from .report import CATEGORY_INDEX, STRIDED, Tracker

__all__ = ["DispatchTracker"]

DYNAMO_LOG = "torch._dynamo.convert_frame"          # where Dynamo says why it skipped a frame
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep     # labkit/memory/


class CompiledCodeSeen(logging.Filter):
    """Catch Dynamo's "skipping ... torch dispatch mode present" note, silence only what we enabled."""

    def __init__(self, shown_from):
        super().__init__()
        self.shown_from, self.frames = shown_from, []
        self.level_before = None

    def filter(self, record):
        if record.levelno < self.shown_from:
            msg = record.getMessage()
            if "dispatch mode" in msg:
                if f"file: {PACKAGE_DIR}" not in msg:   # labkit's own callbacks (a storage's weakref), not the user's code
                    self.frames.append(msg.split(" (reason")[0].removeprefix("skipping: "))
            return False
        return True


class DispatchTracker(Tracker, TorchDispatchMode):
    """`track(..., backend="dispatch")`: counts storages op by op (see the module docstring)."""
    backend = "dispatch"
    takes_budget = True
    nests = True

    def __init__(self, *objs, budget=None, device=None, snapshot=None):
        super().__init__(*objs, budget=budget, device=device, snapshot=snapshot)
        self._live = {}        # id(storage) -> [serial, nbytes, weakref]
        self._compiled = None  # the filter that hears Dynamo skip a compiled frame, while the block runs

    # ---- counting -------------------------------------------------------------------------
    def _see_storage(self, st, t, category):
        key = id(st)
        entry = self._live.get(key)
        if entry is None:
            self._new(st, key, CATEGORY_INDEX[category] if category else self._phase[-1], t)
        else:
            if category is not None:
                self._relabel(entry[0], CATEGORY_INDEX[category])
            if st.nbytes() != entry[1]:                # resized in place (resize_, out=)
                self._resized(entry, st, t)

    def _new(self, st, key, cat, t):
        serial = len(self._label)
        self._label.append(cat)
        nbytes = st.nbytes()
        self._live[key] = [serial, nbytes, weakref.ref(st, functools.partial(self._free, key))]
        self._serials.append(serial)         # = self._change(serial, nbytes, t), inlined: once per allocation
        self._deltas.append(nbytes)
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        if self.budget is not None and self.live > self.budget:
            self._serials.pop(), self._deltas.pop()
            self.live -= nbytes
            self._change(serial, nbytes, t)              # raises, naming the budget and the tensor

    def _resized(self, entry, st, t):
        delta = st.nbytes() - entry[1]
        entry[1] += delta
        self._change(entry[0], delta, t)

    def _change(self, serial, delta, t=None):
        super()._change(serial, delta, t)
        if self.budget is not None and delta > 0 and self.live > self.budget:
            raise torch.OutOfMemoryError(
                    f"budget {fmt_bytes(self.budget)} exceeded: live {fmt_bytes(self.live)} after allocating "
                    f"{fmt_bytes(delta)} ({tuple(t.shape) if t is not None else ''} {getattr(t, 'dtype', '')})")

    def storage_resized(self, st):
        """`UntypedStorage.resize_` inside the block (FSDP frees and refills parameters that way): a storage
        this tracker counts shrinks or grows in its books. One it never saw stays unseen."""
        if self._closed or self.device is not None and st.device.type != self.device:
            return
        entry = self._live.get(id(st))
        if entry is not None and st.nbytes() != entry[1]:
            self._resized(entry, st, None)

    _storage_resized = storage_resized      # the name it had before

    def _free(self, key, ref):
        if self._closed:
            return
        entry = self._live.get(key)
        if entry is not None and entry[2] is ref:
            del self._live[key]
            self._serials.append(entry[0])
            self._deltas.append(-entry[1])
            self.live -= entry[1]

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps __torch_dispatch__ in a Dynamo-disabling frame (a third of the per-op cost). Dynamo
        # skips every frame while this mode is on (see _start_counting), so the wrapper guards nothing here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor and out.layout == STRIDED and self.device is None:   # the common case, inline
            st = out.untyped_storage()
            key = id(st)
            entry = self._live.get(key)
            if entry is None:
                fresh = FRESH.get(func)
                if fresh is None:
                    fresh = FRESH[func] = returns_fresh(func)
                if fresh or key not in input_storages(args, kwargs):
                    self._new(st, key, self._phase[-1], out)
            elif st.nbytes() != entry[1]:
                self._resized(entry, st, out)
        elif isinstance(out, torch.Tensor):
            self._output(out, func, args, kwargs)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._output(t, func, args, kwargs)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._output(u, func, args, kwargs)
        return out

    def _output(self, t, func, args, kwargs):
        if t.layout != STRIDED or self.device is not None and t.device.type != self.device:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(st)
        entry = self._live.get(key)
        if entry is None:
            # An output that shares an input's storage (a view, an in-place op) allocated nothing,
            # even if that storage was born before tracking began and is seen here for the first time.
            # Ops whose schema returns fresh tensors skip the look at the inputs (most of them).
            fresh = FRESH.get(func)
            if fresh is None:
                fresh = FRESH[func] = returns_fresh(func)
            if fresh or key not in input_storages(args, kwargs):
                self._new(st, key, self._phase[-1], t)
        elif st.nbytes() != entry[1]:
            self._resized(entry, st, t)

    # ---- the block ------------------------------------------------------------------------
    def _start_counting(self):
        """Listen (only) for Dynamo's note that it skipped a compiled frame because of this mode, and
        see storage resizes."""
        log = logging.getLogger(DYNAMO_LOG)
        self._compiled = CompiledCodeSeen(log.getEffectiveLevel())
        self._compiled.level_before = log.level
        log.addFilter(self._compiled)
        log.setLevel(logging.DEBUG)
        if not RESIZING:
            torch.UntypedStorage.resize_ = resize_counted
        RESIZING.append(self)

    def _stop_counting(self):
        if self in RESIZING:
            RESIZING.remove(self)
            if not RESIZING:
                torch.UntypedStorage.resize_ = RESIZE
        if self._compiled is not None:
            logging.getLogger(DYNAMO_LOG).removeFilter(self._compiled)
            logging.getLogger(DYNAMO_LOG).setLevel(self._compiled.level_before)

    def _enter_mode(self):
        return TorchDispatchMode.__enter__(self)

    def _exit_mode(self, kind, exc, tb):
        TorchDispatchMode.__exit__(self, kind, exc, tb)

    def _check_block(self):
        if self._compiled is not None and self._compiled.frames:
            raise RuntimeError(
                f"compiled code ran inside lk.track(): torch.compile does not run under a dispatch mode, so "
                f"{', '.join(sorted(set(self._compiled.frames)))} ran eagerly and what was counted is not what "
                "the compiled code allocates. Measure it with lk.track(..., backend='profiler').")


RESIZING = []                # dispatch trackers inside their block: each is told of a storage resize
RESIZE = torch.UntypedStorage.resize_


def resize_counted(storage, size):
    """torch.UntypedStorage.resize_ while a dispatch tracker runs: a storage resize is no dispatched op on
    a tensor, so no TorchDispatchMode sees it; each active tracker is told after the resize."""
    out = RESIZE(storage, size)
    for tracker in list(RESIZING):
        tracker.storage_resized(storage)
    return out


FRESH = {}     # op -> its schema says every output is a new tensor (no alias annotation)


def returns_fresh(func):
    """Whether every output of op `func` is a new tensor by its schema (no alias annotation)."""
    schema = getattr(func, "_schema", None)
    if schema is None or func in (torch.ops.aten._unsafe_view.default,):   # a view its schema calls new
        return False
    return not any(r.alias_info is not None for r in schema.returns)


def input_storages(args, kwargs):
    """ids of the storages of an op's tensor arguments (tensors and lists of tensors, as in aten)."""
    ids = set()
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            if isinstance(a, torch.Tensor):
                ids.add(storage_id(a))
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        ids.add(storage_id(b))
    return ids


def storage_id(t):
    """id of a strided tensor's storage object (the same object while the storage lives), else None."""
    if not isinstance(t, torch.Tensor) or t.layout != STRIDED:
        return None
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None
