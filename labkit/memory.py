"""Count live tensor memory by category, on any device, also under FakeTensorMode and on meta.

`track()` sees every tensor an op creates (a `TorchDispatchMode`), counts its storage once (views
share storage), and subtracts it when the storage dies (a weak reference's callback). Every allocation
and free is an event; the timeline is built from the events with each storage's *final* category, so a
tensor born in backward that ends up as `param.grad` is a gradient for its whole life. `trace` lists
the same events as allocations and frees with sizes and categories, for `labkit.alloc.replay`.
On CUDA the allocator's own peak (`torch.cuda.max_memory_allocated`) is read as well.

What the dispatch-mode tracker cannot see (say so wherever it matters):
- tensors made by other threads: a dispatch mode is per thread (the autograd engine's own threads
  inherit it; a `threading.Thread` or a DataLoader worker you start does not);
- `resize_` (or an `out=` op growing) a storage born before the block and not passed in: only storages
  it counted can grow or shrink in its books (`untyped_storage().resize_()`, how FSDP frees and refills
  parameters, is no dispatched op: `track()` wraps `torch.UntypedStorage.resize_` while a block runs);
- code compiled by `torch.compile`: Dynamo will not run a compiled graph under a dispatch mode; it
  falls back to eager (and, in torch 2.13, keeps running that function eagerly afterwards), so what
  would be counted is not what the compiled code allocates. `track()` refuses such a block with a
  clear error; `track(..., backend="profiler")` counts it instead, from the `[memory]` events of
  `torch.profiler` (`profile_memory=True`), whose running sum equals the dispatch tracker's count in
  eager, byte for byte (tests/test_memory.py checks it). Its categories come from the same hooks
  (module forward = activations, `.grad` = gradients, optimizer state), replayed in time order
  against the profiler's events through instant `record_function` markers.

Cost (benchmarks/track_overhead.py): any Python dispatch mode, even one that does nothing, makes
each op pay a trip through Python; the counting adds a dict look-up, a weak reference and two list
appends per allocation. The timeline is built once, when first read, and cached.
"""
from __future__ import annotations

import collections.abc
import contextlib
import functools
import logging
import os
import re
import sys
import tempfile
import warnings
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .units import fmt_bytes, parse_bytes

__all__ = ["CATEGORIES", "BACKENDS", "track", "Tracker"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other")
BACKENDS = ("dispatch", "profiler")
_CAT = {c: i for i, c in enumerate(CATEGORIES)}
_OTHER, _ACTIVATIONS = _CAT["other"], _CAT["activations"]
_STRIDED = torch.strided
_DYNAMO_LOG = "torch._dynamo.convert_frame"     # where Dynamo says why it skipped a frame
_HERE = os.path.abspath(__file__)


def track(*objs, budget=None, device=None, snapshot=None, backend="dispatch"):
    """Context manager: peak and timeline of live tensor bytes, by category.

    objs: modules, optimizers, tensors (or lists/dicts of them) that already exist; their memory is
    counted from the start and gives the categories (a module's parameters and grads, an optimizer's
    state). Tensors made inside the block are counted as they are created. Only weak references are
    kept: once the block ends, deleting the model frees it even while the report lives.
    budget: bytes or "2 GiB"; past it an op raises `torch.OutOfMemoryError` (what `lk.budget` uses).
    device: count only tensors on this device type ("cpu", "cuda", "meta"); default: all.
    snapshot: on CUDA, a file to write the allocator's memory snapshot to (open it with
    https://pytorch.org/memory_viz); ignored elsewhere.
    Categories: "kv_cache" is a K/V cache kept for later tokens (no autograd graph); in a training
    forward with `use_cache` on, the cache's K and V are tensors backward needs: "activations".
    backend: "dispatch" (default) counts storages op by op, also on fake and meta tensors; it cannot
    see other threads, `resize_` of storages born before the block, nor compiled code (it raises if
    a `torch.compile`d function runs in the block). "profiler" sums `torch.profiler`'s memory events
    instead, with the same report and categories: it sees compiled code and `resize_`, not other
    threads either (the profiler too records the thread that started it), not fake/meta tensors
    (nothing is allocated); no budget; `live` and `peak` are known once the block ends. Inside
    compiled code the submodules' hooks do not run: pass the compiled module itself
    (`track(compiled_model, opt, backend="profiler")`) to get its "forward" marks.
    Nesting: dispatch trackers nest, each counting on its own (an `lk.budget` inside an `lk.track`); a
    profiler tracker nests with none (RuntimeError).
    """
    return Tracker(*objs, budget=budget, device=device, snapshot=snapshot, backend=backend)


def _objects(objs, fn):
    """objs as given, with each one-shot iterator (`model.parameters()`, a generator, `map`) read into a
    list once: walked later, it would be empty and the tracker or guard would silently see nothing."""
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


class _CompiledCodeSeen(logging.Filter):
    """Catch Dynamo's "skipping ... torch dispatch mode present" note, silence only what we enabled."""

    def __init__(self, shown_from):
        super().__init__()
        self.shown_from, self.frames = shown_from, []

    def filter(self, record):
        if record.levelno < self.shown_from:
            msg = record.getMessage()
            if "dispatch mode" in msg:
                if f"file: {_HERE}" not in msg:   # labkit's own callbacks (a storage's weakref), not the user's code
                    self.frames.append(msg.split(" (reason")[0].removeprefix("skipping: "))
            return False
        return True


class Tracker(TorchDispatchMode):
    """The report of `track()`: `peak`, `peak_parts`, `max_parts`, `timeline`, `live`, `marks`, `at()`."""

    def __init__(self, *objs, budget=None, device=None, snapshot=None, backend="dispatch"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.snapshot = snapshot
        self.budget = None if budget is None else parse_bytes(budget, "budget")
        if self.budget is not None and backend != "dispatch":
            raise ValueError(f"budget needs backend='dispatch' (it stops the op that passes it), got backend={backend!r}")
        kind = str(device).split(":")[0] if device is not None else None
        if kind not in (None, "cpu", "cuda", "meta", "mps", "xpu"):
            raise ValueError(f"device must be a device type like 'cpu', 'cuda' or 'meta', got {device!r}")
        self.device = kind
        objs = _objects(objs, "track")
        self._objs = objs      # dropped once counted: the report keeps no model alive
        self._live = {}        # id(storage) -> [serial, nbytes, weakref]
        self._label = []       # serial -> category index (the latest wins, for the whole lifetime)
        self._serials, self._deltas = [], []    # the events: which storage, +/- bytes
        self._version = 0      # bumped when a label changes: the cached timeline is stale
        self._cache_key, self._cache = None, None
        self._builds = 0       # how many times the timeline was built (tests count it)
        self.marks = []        # (event index, text)
        self._phase = [_OTHER]
        self._hooks = []
        self._closed = False
        self._cmds = []        # profiler backend: what the hooks did, replayed against its events
        self._where = {}       # profiler backend: (device type, address) -> serial of what lives there
        self._entered = False
        self.live = self.peak = 0
        self.cuda = None

    # ---- counting (dispatch backend) ------------------------------------------------------
    def _see(self, t, category=None):
        if not isinstance(t, torch.Tensor) or t.layout != _STRIDED:
            return
        if self.device is not None and t.device.type != self.device:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):   # tensors without storage (some subclasses)
            return
        if self.backend == "profiler":
            return self._see_address(st, category)
        key = id(st)
        entry = self._live.get(key)
        if entry is None:
            self._new(st, key, _CAT[category] if category else self._phase[-1], t)
        else:
            if category is not None and self._label[entry[0]] != _CAT[category]:
                self._label[entry[0]] = _CAT[category]
                self._version += 1
            if st.nbytes() != entry[1]:                # resized in place (resize_, out=)
                self._resized(entry, st, t)

    def _see_address(self, st, category):
        try:
            addr = None if st.device.type == "meta" else (st.device.type, st.data_ptr())
        except (RuntimeError, NotImplementedError):
            addr = None
        if addr is None:
            raise ValueError("backend='profiler' counts real allocations; fake or meta tensors need "
                             f"backend='dispatch', got a tensor on {st.device}")
        if self._prof is not None:               # inside the block: replayed against the events later
            self._cmds.append(("label", addr, _CAT[category or "other"]))
            self._signal()
        elif addr not in self._where and not self._closed:   # what the objects passed in hold
            self._where[addr] = len(self._label)
            self._label.append(_CAT[category or "other"])
            self._change(self._where[addr], st.nbytes())
        elif addr in self._where and category is not None:
            self._label[self._where[addr]] = _CAT[category]
            self._version += 1

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
        self._serials.append(serial)
        self._deltas.append(delta)
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live
        if self.budget is not None and delta > 0 and self.live > self.budget:
            raise torch.OutOfMemoryError(
                    f"budget {fmt_bytes(self.budget)} exceeded: live {fmt_bytes(self.live)} after allocating "
                    f"{fmt_bytes(delta)} ({tuple(t.shape) if t is not None else ''} {getattr(t, 'dtype', '')})")

    def _storage_resized(self, st):
        """`UntypedStorage.resize_` inside the block (FSDP frees and refills parameters that way): a storage
        this tracker counts shrinks or grows in its books. One it never saw stays unseen."""
        if self._closed or self.device is not None and st.device.type != self.device:
            return
        entry = self._live.get(id(st))
        if entry is not None and st.nbytes() != entry[1]:
            self._resized(entry, st, None)

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
        # skips every frame while this mode is on (see _watch_compiled), so the wrapper guards nothing here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor and out.layout == _STRIDED and self.device is None:   # the common case, inline
            st = out.untyped_storage()
            key = id(st)
            entry = self._live.get(key)
            if entry is None:
                fresh = _FRESH.get(func)
                if fresh is None:
                    fresh = _FRESH[func] = _returns_fresh(func)
                if fresh or key not in _input_storages(args, kwargs):
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
        if t.layout != _STRIDED or self.device is not None and t.device.type != self.device:
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
            fresh = _FRESH.get(func)
            if fresh is None:
                fresh = _FRESH[func] = _returns_fresh(func)
            if fresh or key not in _input_storages(args, kwargs):
                self._new(st, key, self._phase[-1], t)
        elif st.nbytes() != entry[1]:
            self._resized(entry, st, t)

    # ---- categories -----------------------------------------------------------------------
    def label(self, obj, category):
        """Count every tensor in `obj` (tensor, module, optimizer, list/dict, HF cache) as `category`."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        for t in _tensors(obj):
            self._see(t, category)

    def mark(self, text):
        """Put a named mark on the timeline at this moment."""
        if self._prof is not None:
            self._cmds.append(("mark", str(text)))
            self._signal()
        else:
            self.marks.append((len(self._serials), str(text)))

    def _register(self, obj):
        """Count what `obj` holds; hooks that name what it makes (removed on exit: no reference stays)."""
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
            self._hooks.append(obj.register_step_pre_hook(lambda *a: self._enter_phase(_OTHER, "step")))
            self._hooks.append(obj.register_step_post_hook(lambda o, *a: self._step_done(o)))
        else:                                # tensors, containers: nn.Parameters count as parameters
            found = list(_tensors(obj))
            params = [t for t in found if isinstance(t, torch.nn.Parameter)]
            grads = [p.grad for p in params if p.grad is not None]
            taken = {id(t) for t in params + grads}
            self.label([t for t in found if id(t) not in taken], "other")
            self.label(params, "parameters")
            self.label(grads, "gradients")
            for p in params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda p: self._see(p.grad, "gradients")))

    def _enter_phase(self, category, text):
        self._push(category)
        self.mark(text)

    def _push(self, category):
        self._phase.append(category)
        if self._prof is not None:
            self._cmds.append(("push", category))
            self._signal()

    def _pop(self):
        if len(self._phase) > 1:
            self._phase.pop()
        if self._prof is not None:
            self._cmds.append(("pop",))
            self._signal()

    # Whatever any module's forward creates is an activation: also the forward that activation
    # checkpointing re-runs during backward. Global hooks, so that submodules count too.
    def _module_pre(self, module, args):
        self._push(_ACTIVATIONS)

    def _module_post(self, module, args, out):
        self._pop()

    def _forward_post(self, module, args, out):
        self.mark("forward end")
        if isinstance(out, dict):            # transformers' ModelOutput: its KV cache is a cache
            for key, value in out.items():   # items(), not out.get("past_key_values"): no deprecation warning
                if key in ("cache", "past_key_values") and value is not None and not _saved_for_backward(value):
                    self.label(value, "kv_cache")
        first = next((t for t in _tensors(out) if t.requires_grad), None)
        if first is not None and torch.is_grad_enabled():
            first.register_hook(lambda g: self.mark("backward"))

    def _step_done(self, optimizer):
        self._pop()
        self.label(optimizer.state, "optimizer")
        self.mark("step end")

    # ---- context --------------------------------------------------------------------------
    _prof = None

    def __enter__(self):
        if self._entered:
            raise RuntimeError("a track() report can be entered once; start a new lk.track(...) for another block")
        self._entered = True
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.cuda = {"allocated_start": torch.cuda.memory_allocated()}
        objs, self._objs = self._objs, ()
        limit, self.budget = self.budget, None
        try:
            for obj in objs:                 # count what is already held, then check the budget
                self._register(obj)
            del objs
            self.budget = limit
            if self.budget is not None and self.live > self.budget:
                held = ", ".join(f"{c} {fmt_bytes(b)}" for c, b in self._parts_now().items() if b)
                raise torch.OutOfMemoryError(
                    f"budget {fmt_bytes(self.budget)} exceeded before the block ran: what was passed in "
                    f"already holds {fmt_bytes(self.live)} ({held})")
            self._hooks.append(register_module_forward_pre_hook(self._module_pre))
            self._hooks.append(register_module_forward_hook(self._module_post, always_call=True))
            # torch warns that a compiled module's global hooks fire once more (for the OptimizedModule):
            # ours only push and pop a phase, so that is harmless; that one warning is ignored in the block.
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            self.start = self.live
            self.mark("start")
            profilers = [t for t in _ACTIVE if t.backend == "profiler"]
            if profilers or (self.backend == "profiler" and _ACTIVE):
                raise RuntimeError("lk.track(backend='profiler') does not nest with another lk.track() (one torch "
                                   "profiler at a time, and it would count the other tracker's work): end the "
                                   "outer block first")
            if self.backend == "profiler":
                self._start_profiler()
            else:
                self._watch_compiled()
            _activate(self)
            if self.cuda is not None and self.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            return super().__enter__() if self.backend == "dispatch" else self
        except BaseException:
            self.budget = limit
            self._close()
            raise

    def __exit__(self, kind, exc, tb):
        if self.backend == "dispatch":
            super().__exit__(kind, exc, tb)
        self._close()
        self.mark("end")
        if self._compiled is not None and self._compiled.frames and kind is None:
            raise RuntimeError(
                f"compiled code ran inside lk.track(): torch.compile does not run under a dispatch mode, so "
                f"{', '.join(sorted(set(self._compiled.frames)))} ran eagerly and what was counted is not what "
                "the compiled code allocates. Measure it with lk.track(..., backend='profiler').")
        return False

    def _close(self):
        """Remove every hook, stop counting frees; keep what was measured. Safe to call twice."""
        _deactivate(self)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._closed = True
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None
        if self._compiled is not None:
            logging.getLogger(_DYNAMO_LOG).removeFilter(self._compiled)
            logging.getLogger(_DYNAMO_LOG).setLevel(self._compiled.level_before)
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.__exit__(None, None, None)
            finally:
                self._notes.__exit__(None, None, None)
            self._replay(prof)
        if self.cuda is not None and "peak_allocated" not in self.cuda:
            torch.cuda.synchronize()
            self.cuda.update(peak_allocated=torch.cuda.max_memory_allocated(),
                             peak_reserved=torch.cuda.max_memory_reserved())
            if self.snapshot:
                torch.cuda.memory._dump_snapshot(str(self.snapshot))
                torch.cuda.memory._record_memory_history(enabled=None)

    _compiled = None
    _warnings = None

    def _watch_compiled(self):
        """Listen (only) for Dynamo's note that it skipped a compiled frame because of this mode."""
        log = logging.getLogger(_DYNAMO_LOG)
        self._compiled = _CompiledCodeSeen(log.getEffectiveLevel())
        self._compiled.level_before = log.level
        log.addFilter(self._compiled)
        log.setLevel(logging.DEBUG)

    # ---- the profiler backend ---------------------------------------------------------------
    def _start_profiler(self):
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self._notes = _without_profiler_notes()          # until the block ends: see its docstring
        self._notes.__enter__()
        logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(_drop_record_function_note)
        self._prof.__enter__()

    def _signal(self):
        """An instant op in the profiler's trace: puts the latest command at this moment."""
        with torch.profiler.record_function(f"labkit::{len(self._cmds) - 1}"):
            pass

    def _replay(self, prof):
        """Running sum of the profiler's [memory] events, with the hooks' commands in time order."""
        from torch._C._profiler import _EventType
        timed, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            kind, fields = e.typed
            if kind == _EventType.Allocation:
                timed.append((e.start_time_ns, 0, fields))
            elif kind == _EventType.TorchOp and fields.name.startswith("labkit::"):
                timed.append((e.start_time_ns, 1, self._cmds[int(fields.name[8:])]))
        timed.sort(key=lambda x: (x[0], x[1]))
        where, self._phase = self._where, [_OTHER]
        for _, is_cmd, item in timed:
            if not is_cmd:
                dev = item.device.type
                if item.alloc_size == 0 or self.device is not None and dev != self.device:
                    continue
                if item.alloc_size > 0:
                    serial = len(self._label)
                    self._label.append(self._phase[-1])
                    where[(dev, item.ptr)] = serial
                    self._change(serial, item.alloc_size)
                elif (dev, item.ptr) in where:   # a free of what was born before and not counted: skip
                    self._change(where.pop((dev, item.ptr)), item.alloc_size)
            elif item[0] == "mark":
                self.marks.append((len(self._serials), item[1]))
            elif item[0] == "push":
                self._phase.append(item[1])
            elif item[0] == "pop":
                if len(self._phase) > 1:
                    self._phase.pop()
            elif item[1] in where:               # "label"
                self._label[where[item[1]]] = item[2]
        self._version += 1

    # ---- the report -----------------------------------------------------------------------
    @property
    def events(self):
        """The allocation trace: [(storage serial, +bytes allocated or -bytes freed)], in order."""
        return list(zip(self._serials, self._deltas))

    _events = events          # the name it had before

    @property
    def trace(self):
        """The allocation trace for `labkit.alloc.replay`: [(serial, +bytes, category) | (serial, -bytes, category)].

        One entry per storage allocation and free, in order, each tagged with the storage's final category
        (also under FakeTensorMode and on meta, where nothing is really allocated). A storage resized in
        place appears as a new allocation of its new size for the same serial (on CUDA a resize allocates
        the new block, copies, then frees the old one); zero-byte storages allocate nothing and are left out.
        Built from the events when read: tracking itself pays nothing for it.
        """
        out, size, label = [], {}, self._label
        for serial, delta in zip(self._serials, self._deltas):
            cat = CATEGORIES[label[serial]]
            now = size.get(serial, 0) + delta
            if delta > 0 or serial in size and now > 0:          # a birth, or a resize to `now` bytes
                if now > 0:
                    size[serial] = now
                    out.append((serial, now, cat))
            elif serial in size:                                 # freed (or resized to nothing)
                out.append((serial, -size.pop(serial), cat))
        return out

    def _parts_now(self):
        sums = [0] * len(CATEGORIES)
        for serial, delta in zip(self._serials, self._deltas):
            sums[self._label[serial]] += delta
        return dict(zip(CATEGORIES, sums))

    def _built(self):
        """The timeline, built once per state of the events and labels (reading it again is free)."""
        key = (len(self._serials), self._version)
        if self._cache_key != key:
            self._builds += 1
            serials = np.fromiter(self._serials, dtype=np.int64, count=len(self._serials))
            deltas = np.fromiter(self._deltas, dtype=np.int64, count=len(self._deltas))
            cats = np.asarray(self._label, dtype=np.int64)[serials] if len(serials) else serials
            steps = np.zeros((len(serials) + 1, len(CATEGORIES)), dtype=np.int64)
            steps[np.arange(1, len(serials) + 1), cats] = deltas
            sums = np.cumsum(steps, axis=0)
            out = {c: sums[:, i] for c, i in _CAT.items()}
            out["total"] = sums.sum(axis=1)
            for a in out.values():
                a.flags.writeable = False
            i = int(np.argmax(out["total"]))
            self._cache = (out, {c: int(out[c][i]) for c in CATEGORIES}, {c: int(out[c].max()) for c in CATEGORIES})
            self._cache_key = key
        return self._cache

    @property
    def timeline(self):
        """Bytes per category after every event: {category: read-only array}, plus "total"."""
        return self._built()[0]

    @property
    def peak_parts(self):
        """The breakdown by category at the moment of the peak."""
        return dict(self._built()[1])

    @property
    def max_parts(self):
        """Each category's own maximum over the block (they need not coincide)."""
        return dict(self._built()[2])

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


def _saved_for_backward(cache):
    """A cache filled by a forward that records a graph (training with `use_cache` left on): its K and V are
    what attention saved for backward, so they stay activations, as lk.estimate counts them. A cache is
    "kv_cache" only when it is kept for later tokens without a graph (generate, inference)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(cache))


_ACTIVE = []                 # trackers inside their block, innermost last
_RESIZE = torch.UntypedStorage.resize_


def _resize_counted(storage, size):
    """torch.UntypedStorage.resize_ while a dispatch tracker runs: a storage resize is no dispatched op on
    a tensor, so no TorchDispatchMode sees it; each active tracker is told after the resize."""
    out = _RESIZE(storage, size)
    for tracker in list(_ACTIVE):
        if tracker.backend == "dispatch":
            tracker._storage_resized(storage)
    return out


def _activate(tracker):
    if not _ACTIVE:
        torch.UntypedStorage.resize_ = _resize_counted
    _ACTIVE.append(tracker)


def _deactivate(tracker):
    if tracker in _ACTIVE:
        _ACTIVE.remove(tracker)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _RESIZE


def _drop_record_function_note(record):
    """Dynamo's one-time note that it ignores a `record_function` inside compiled code. The profiler
    backend's marks sit outside compiled code, so the note says nothing a learner needs: drop it alone."""
    return "Profiler record function" not in record.getMessage()


@contextlib.contextmanager
def _without_profiler_notes():
    """Drop the profiler's own notes to file descriptor 2: kineto's "STAGE:"/"USDT:" lines at every start
    and stop, and c10's one-time "Memory block of unknown size was allocated before the profiling
    started" when a block born before is freed. Anything else written to descriptor 2 meanwhile
    (C++ code only: Python's sys.stderr is untouched) is passed on to sys.stderr when the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not (re.match(r"(STAGE|USDT):\d{4}-\d\d-\d\d ", line)
                        or "Memory block of unknown size was allocated before the profiling started" in line):
                    sys.stderr.write(line)


_FRESH = {}     # op -> its schema says every output is a new tensor (no alias annotation)


def _returns_fresh(func):
    schema = getattr(func, "_schema", None)
    if schema is None or func in (torch.ops.aten._unsafe_view.default,):   # a view its schema calls new
        return False
    return not any(r.alias_info is not None for r in schema.returns)


def _input_storages(args, kwargs):
    """ids of the storages of an op's tensor arguments (tensors and lists of tensors, as in aten)."""
    ids = set()
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            if isinstance(a, torch.Tensor):
                ids.add(_storage_id(a))
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        ids.add(_storage_id(b))
    return ids


def _storage_id(t):
    """id of a strided tensor's storage object (the same object while the storage lives), else None."""
    if not isinstance(t, torch.Tensor) or t.layout != _STRIDED:
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
