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
import sys
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..units import fmt_bytes
from .report import ACTIVATIONS, CATEGORY_INDEX, GRADIENTS, PARAMETERS, STRIDED, Tracker, held

__all__ = ["DispatchTracker"]

DYNAMO_LOG = "torch._dynamo.convert_frame"          # where Dynamo says why it skipped a frame
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep     # labkit/memory/


class CompiledCodeSeen(logging.Filter):
    """Catch Dynamo's "skipping ... torch dispatch mode present" note for every dispatch tracker in its block
    (one filter for all: a filter that drops a record hides it from the filters after it, so nested trackers
    each with their own heard nothing but the outermost), and silence only what we enabled."""

    def __init__(self, shown_from, level_before):
        super().__init__()
        self.shown_from, self.level_before = shown_from, level_before

    def filter(self, record):
        if record.levelno < self.shown_from:
            msg = record.getMessage()
            if "dispatch mode" in msg:
                if f"file: {PACKAGE_DIR}" not in msg:   # labkit's own callbacks (a storage's weakref), not the user's code
                    for tracker in RESIZING:
                        tracker.compiled_frames.append(msg.split(" (reason")[0].removeprefix("skipping: "))
            return False
        return True


class Entry(weakref.ref):
    """A storage in the books: a weak reference to it (its callback books the free), with its key in `_live`
    (the storage's id), its serial and its bytes. One object per storage: cheaper than a list holding a
    weak reference with a `functools.partial` callback (this runs once per allocation)."""
    __slots__ = ("key", "serial", "nbytes")


class DispatchTracker(Tracker, TorchDispatchMode):
    """`track(..., backend="dispatch")`: counts storages op by op (see the module docstring)."""
    backend = "dispatch"
    takes_budget = True
    nests = True

    def __init__(self, *objs, budget=None, device=None, snapshot=None):
        super().__init__(*objs, budget=budget, device=device, snapshot=snapshot)
        self._live = {}        # id(storage) -> its Entry, while it lives
        self._gone = self._free  # the Entries' callback, bound once
        self.compiled_frames = []  # what Dynamo skipped because this mode was on, heard while the block runs

    # ---- counting -------------------------------------------------------------------------
    def _see_storage(self, st, t, category):
        key = id(st)
        entry = self._live.get(key)
        if entry is None:
            self._new(st, key, CATEGORY_INDEX[category] if category else self._phase[-1], t)
        else:
            if category is not None:
                self._relabel(entry.serial, CATEGORY_INDEX[category])
            if st.nbytes() != entry.nbytes:            # resized in place (resize_, out=)
                self._resized(entry, st, t)

    def _new(self, st, key, cat, t):
        serial = len(self._label)
        self._label.append(cat)
        entry = self._live[key] = Entry(st, self._gone)
        entry.key, entry.serial, entry.nbytes = key, serial, st.nbytes()
        self._serials.append(serial)         # = self._change(serial, nbytes, t), inlined: once per allocation
        self._deltas.append(entry.nbytes)
        self.live += entry.nbytes
        if self.live > self.peak:
            self.peak = self.live
        if self.budget is not None and self.live > self.budget:
            self._serials.pop(), self._deltas.pop()
            self.live -= entry.nbytes
            self._change(serial, entry.nbytes, t)        # raises, naming the budget and the tensor

    def _resized(self, entry, st, t):
        delta = st.nbytes() - entry.nbytes
        entry.nbytes += delta
        self._change(entry.serial, delta, t)

    def _change(self, serial, delta, t=None):
        super()._change(serial, delta, t)
        if self.budget is not None and delta > 0 and self.live > self.budget:
            raise torch.OutOfMemoryError(
                    f"budget {fmt_bytes(self.budget)} exceeded: live {fmt_bytes(self.live)} after allocating "
                    f"{fmt_bytes(delta)} ({tuple(t.shape) if t is not None else ''} {getattr(t, 'dtype', '')})")

    def storage_resized(self, st, before):
        """`UntypedStorage.resize_` inside the block, from `before` bytes: a storage this tracker counts shrinks
        or grows in its books. One it never saw is counted from the moment it grows from empty, as a parameter:
        FSDP frees a gathered parameter's storage with resize_(0) and refills it with resize_ (FSDP2's
        alloc_storage / free_storage). Another storage it never saw stays unseen."""
        if self._closed or self.device is not None and st.device.type != self.device:
            return
        entry = self._live.get(id(st))
        if entry is None:
            if before == 0 and st.nbytes() > 0:
                self._new(st, id(st), PARAMETERS, None)
        elif st.nbytes() != entry.nbytes:
            self._resized(entry, st, None)

    def _free(self, entry):
        """An Entry's callback: its storage died (after the block: nothing to book, the timeline ended)."""
        if self._closed:
            return
        key, live = entry.key, self._live
        if live.get(key) is entry:
            del live[key]
            nbytes = entry.nbytes
            self._serials.append(entry.serial)
            self._deltas.append(-nbytes)
            self.live -= nbytes

    _free.runs_on_its_own = True             # a weakref callback, whatever code runs when a storage dies: lk.exercise
                                             # does not count it as the answer's call

    def _label_grads(self):                  # Tracker's, its common case inlined: once per backward
        live, label = self._live, self._label
        for p in self._grad_params:
            g = p.grad
            if g is not None:
                entry = live.get(id(g.untyped_storage())) if type(g) is TENSOR else None
                if entry is None:
                    self._see(g, "gradients")
                elif label[entry.serial] != GRADIENTS:
                    self._relabel(entry.serial, GRADIENTS)

    module_hooks = False                     # module calls are followed by `call_counted` instead

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps __torch_dispatch__ in a Dynamo-disabling frame (a third of the per-op cost). Dynamo
        # skips every frame while this mode is on (see _start_counting), so the wrapper guards nothing here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Runs once per op: what it costs is most of what tracking costs (benchmarks/track_overhead.py), so
        # the common case (one plain tensor out, every device counted) is written out here, `_new` inlined.
        op = OPS.get(id(func))
        if op is None:
            op = learn(func)
        out = op[0](*args, **kwargs) if kwargs else op[0](*args)
        if op[1] is VIEW:                                            # t, view, detach, expand: nothing new
            return out
        if (type(out) is TENSOR or type(out) is PARAMETER) and self.device is None:
            try:
                st = out.untyped_storage()
            except (RuntimeError, NotImplementedError):              # sparse, mkldnn, ...: no storage to count
                return out
            key = id(st)
            entry = self._live.get(key)
            if entry is None:
                if op[1] is FRESH or key not in input_storages(args, kwargs):   # new: not an input's storage
                    label = self._label
                    serial, nbytes = len(label), st.nbytes()
                    label.append(self._phase[-1])
                    entry = self._live[key] = Entry(st, self._gone)
                    entry.key, entry.serial, entry.nbytes = key, serial, nbytes
                    self._serials.append(serial)
                    self._deltas.append(nbytes)
                    live = self.live = self.live + nbytes
                    if live > self.peak:
                        self.peak = live
                    if self.budget is not None and live > self.budget:
                        self._serials.pop(), self._deltas.pop()
                        self.live -= nbytes
                        self._change(serial, nbytes, out)            # raises, naming the budget and the tensor
            elif st.nbytes() != entry.nbytes:
                self._resized(entry, st, out)
        elif isinstance(out, torch.Tensor):
            self._output(out, op[1] is FRESH, args, kwargs)
        elif isinstance(out, (tuple, list)):
            for t in out:
                if isinstance(t, torch.Tensor):
                    self._output(t, op[1] is FRESH, args, kwargs)
                elif isinstance(t, (tuple, list)):
                    for u in t:
                        if isinstance(u, torch.Tensor):
                            self._output(u, op[1] is FRESH, args, kwargs)
        return out

    def _output(self, t, fresh, args, kwargs):
        if t.layout != STRIDED or self.device is not None and t.device.type != self.device:
            return
        if not self.counts_fake and isinstance(t, FakeTensor):     # another measurement's shapes: no memory here
            return
        for u in held(t):                            # a DTensor: its local shard
            try:
                st = u.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = id(st)
            entry = self._live.get(key)
            if entry is None:
                # An output that shares an input's storage (a view, an in-place op) allocated nothing,
                # even if that storage was born before tracking began and is seen here for the first time.
                # Ops whose schema returns fresh tensors skip the look at the inputs (most of them).
                if fresh or key not in input_storages(args, kwargs):
                    self._new(st, key, self._phase[-1], u)
            elif st.nbytes() != entry.nbytes:
                self._resized(entry, st, u)

    # ---- the block ------------------------------------------------------------------------
    def _start_counting(self):
        """See storage resizes, and listen (only) for Dynamo's note that it skipped a compiled frame because
        a dispatch mode was on: the first tracker to start installs both for every tracker in its block."""
        if not RESIZING:
            torch.UntypedStorage.resize_ = resize_counted
            torch.nn.Module.__call__ = call_counted
            if "torch._dynamo" in sys.modules:       # only if loaded: importing Dynamo takes seconds
                dynamo_skips_dispatch()
            log = logging.getLogger(DYNAMO_LOG)
            LISTENER.append(CompiledCodeSeen(log.getEffectiveLevel(), log.level))
            log.addFilter(LISTENER[0])
            log.setLevel(logging.DEBUG)
        RESIZING.append(self)

    def _stop_counting(self):
        if self in RESIZING:
            RESIZING.remove(self)
            if not RESIZING:
                torch.UntypedStorage.resize_ = RESIZE
                torch.nn.Module.__call__ = CALL
                log = logging.getLogger(DYNAMO_LOG)
                log.removeFilter(LISTENER[0])
                log.setLevel(LISTENER.pop().level_before)

    def _enter_mode(self):
        return TorchDispatchMode.__enter__(self)

    def _exit_mode(self, kind, exc, tb):
        TorchDispatchMode.__exit__(self, kind, exc, tb)

    def _check_block(self):
        if self.compiled_frames:
            raise RuntimeError(
                f"compiled code ran inside lk.track(): torch.compile does not run under a dispatch mode, so "
                f"{', '.join(sorted(set(self.compiled_frames)))} ran eagerly and what was counted is not what "
                "the compiled code allocates. Measure it with lk.track(..., backend='profiler').")


RESIZING = []                # dispatch trackers inside their block: each is told of a storage resize and of
                             # each module call
RESIZE = torch.UntypedStorage.resize_
LISTENER = []                # the one CompiledCodeSeen filter while any dispatch tracker is in its block


def resize_counted(storage, size):
    """torch.UntypedStorage.resize_ while a dispatch tracker runs: a storage resize is no dispatched op on
    a tensor, so no TorchDispatchMode sees it; each active tracker is told after the resize."""
    before = storage.nbytes()
    out = RESIZE(storage, size)
    for tracker in list(RESIZING):
        tracker.storage_resized(storage, before)
    return out


CALL = torch.nn.Module.__call__


def call_counted(module, *args, **kwargs):
    """torch.nn.Module.__call__ while a dispatch tracker runs: whatever a module's forward makes is an activation
    (submodules', and the forward that activation checkpointing re-runs in backward). Global module hooks would
    do the same, but they send every module call down nn.Module's slow path (a tenth of the cost of tracking
    small steps); this is one more Python frame. Dynamo never traces it: it skips every frame while a dispatch
    mode is on."""
    for tracker in RESIZING:
        tracker._phase.append(ACTIVATIONS)
    try:
        return CALL(module, *args, **kwargs)
    finally:
        for tracker in RESIZING:
            if len(tracker._phase) > 1:
                tracker._phase.pop()


TENSOR, PARAMETER = torch.Tensor, torch.nn.Parameter
FRESH, VIEW, OTHER = "fresh", "view", "other"     # what an op's outputs are, by its schema
OPS = {}       # id(op) -> (what to call, FRESH/VIEW/OTHER, the op: kept alive, so that its id is no other op's)


@functools.cache
def dynamo_skips_dispatch():
    """Dynamo inlines a dispatch mode's __torch_dispatch__ while it traces a compiled function run under it, and
    warns about the C++ op handle `learn` calls ("does not know how to trace the builtin ..."). The tracker
    refuses such a block anyway: Dynamo is told to skip this code (torch's own `_should_skip_dynamo` wrapper
    would instead cost every op a frame)."""
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:                     # moved or gone in this torch: the warning is the only cost
        return
    skip_code(DispatchTracker.__torch_dispatch__.__code__)


def learn(func):
    """OPS' entry for `func`. An aten OpOverload is called through its C++ handle `_op`: `func(...)` would add
    one Python frame (OpOverload.__call__) to every op."""
    OPS[id(func)] = op = (getattr(func, "_op", func), op_kind(func), func)
    return op


def op_kind(func):
    """FRESH: every output of op `func` is a new tensor by its schema (no alias annotation); VIEW: every output
    is a read-only alias of an input (`t(Tensor(a) self) -> Tensor(a)`: nothing allocated, nothing resized);
    OTHER: in-place and out= ops (an output written, maybe resized), mixed outputs, unknown schemas."""
    schema = getattr(func, "_schema", None)
    if schema is None or func in (torch.ops.aten._unsafe_view.default,) or not schema.returns:   # a view its
        return OTHER                                                                             # schema calls new
    aliases = [r.alias_info for r in schema.returns]
    if all(a is None for a in aliases):
        return FRESH
    if all(a is not None and not a.is_write and len(a.before_set) <= 1 for a in aliases):   # not `Tensor(a|b)`:
        return VIEW                                                                          # that may be new
    return OTHER



def input_storages(args, kwargs):
    """ids of the storages of an op's tensor arguments (tensors and lists of tensors, as in aten; a wrapper
    subclass by the tensors it wraps)."""
    ids = set()
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            for b in (a if isinstance(a, (list, tuple)) else (a,)):
                if type(b) is TENSOR or type(b) is PARAMETER:
                    ids.add(storage_id(b))
                elif isinstance(b, torch.Tensor):
                    ids.update(storage_id(u) for u in held(b))
    return ids


def storage_id(t):
    """id of a strided tensor's storage object (the same object while the storage lives), else None."""
    if t.layout != STRIDED:
        return None
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None
