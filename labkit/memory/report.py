"""`Tracker`: what both backends of `track()` share, the books, the categories and the report.

The books are two lists of events: which storage (a serial number) and how many bytes it gained
(+) or lost (-). Each serial has a category, and the latest label wins for the storage's whole life,
so a tensor born in backward that ends up as `param.grad` is a gradient from its birth. The report
(`timeline`, `peak_parts`, `trace`, ...) is built from the events when first read, and cached.

The categories come from hooks that both backends install in the same way: a module's forward
makes activations (global module hooks, so submodules count too; the dispatch
backend wraps `nn.Module.__call__` instead), `.grad` is a gradient (read when
each backward ends, before each optimizer step and when the block ends: `torch.autograd.backward` is
wrapped while a block runs, which also marks where each backward starts; no hook per parameter or per
forward), an optimizer's state is "optimizer", a model output's cache kept without a graph is
"kv_cache".
What a backend adds is how it sees storages (`_see_storage`) and how it starts and stops counting
(`_start_counting`, `_stop_counting`): see `dispatch.py` and `profiler.py`.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..units import fmt_bytes, parse_bytes
from .walk import objects, saved_for_backward, tensors

__all__ = ["CATEGORIES", "Tracker"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other")
CATEGORY_INDEX = {c: i for i, c in enumerate(CATEGORIES)}
OTHER, ACTIVATIONS, GRADIENTS = CATEGORY_INDEX["other"], CATEGORY_INDEX["activations"], CATEGORY_INDEX["gradients"]
PARAMETERS = CATEGORY_INDEX["parameters"]
STRIDED = torch.strided
DEVICE_TYPES = (None, "cpu", "cuda", "meta", "mps", "xpu")

ACTIVE = []                  # trackers inside their block, innermost last (both backends)
AUTOGRAD = {}                # torch.autograd.backward and .grad as they were, while wrapped (ACTIVE not empty)


def held(t):
    """The tensors whose storages hold `t`'s data: `t` itself, or for a wrapper subclass (a DTensor, FSDP2's
    sharded parameters) the tensors it wraps (`__tensor_flatten__`): a DTensor holds its local shard, and its
    wrapper's own storage, sized as the global tensor, is no memory of this process."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not is_traceable_wrapper_subclass(t):
        return (t,)
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])    # DTensor: _local_tensor, device_mesh
    return tuple(u for v in inner if isinstance(v, torch.Tensor) for u in held(v))


def fake_mode_active():
    """Whether a FakeTensorMode is on in this thread (a tracker entered inside one counts fake tensors)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


class Tracker:
    """The report of `track()`: `peak`, `peak_parts`, `max_parts`, `timeline`, `live`, `marks`, `at()`.

    A base class: `track()` makes a `DispatchTracker` or a `ProfilerTracker`, which say how storages
    are seen. Class facts a backend states: `backend` (its name), `takes_budget` (whether it can stop
    the op that passes a budget), `nests` (whether other trackers may run inside or around it).
    """
    backend = None
    takes_budget = False
    nests = True

    def __init__(self, *objs, budget=None, device=None, snapshot=None):
        super().__init__()
        self.snapshot = snapshot
        self.budget = None if budget is None else parse_bytes(budget, "budget")
        if self.budget is not None and not self.takes_budget:
            raise ValueError(f"budget needs backend='dispatch' (it stops the op that passes it), "
                             f"got backend={self.backend!r}")
        kind = str(device).split(":")[0] if device is not None else None
        if kind not in DEVICE_TYPES:
            raise ValueError(f"device must be a device type like 'cpu', 'cuda' or 'meta', got {device!r}")
        self.device = kind
        self._objs = objects(objs, "track")     # dropped once counted: the report keeps no model alive
        self._label = []       # serial -> category index (the latest wins, for the whole lifetime)
        self._serials, self._deltas = [], []    # the events: which storage, +/- bytes
        self._version = 0      # bumped when a label changes: the cached timeline is stale
        self._cache_key, self._cache = None, None
        self._builds = 0       # how many times the timeline was built (tests count it)
        self.marks = []        # (event index, text)
        self._phase = [OTHER]  # the category of what is made now: a stack (a forward inside a step)
        self._hooks = []
        self._grad_params = []   # parameters of the modules passed in: their .grad is labelled "gradients"
        self._grads_labelled = False   # by the end of a backward since the last optimizer step
        self._warnings = None
        self._closed = False
        self._entered = False
        self.counts_fake = True   # set on entry: whether fake tensors are this block's memory
        self.live = self.peak = 0
        self.cuda = None

    # ---- the books ------------------------------------------------------------------------
    def _see(self, t, category=None):
        """Count the storage of tensor `t` (if this tracker counts its device), labelled `category`; a wrapper
        subclass by the tensors it wraps (`held`); a fake tensor only where fake tensors are this block's."""
        if not isinstance(t, torch.Tensor) or t.layout != STRIDED:
            return
        if self.device is not None and t.device.type != self.device:
            return
        if not self.counts_fake and isinstance(t, FakeTensor):
            return
        for u in held(t):
            try:
                st = u.untyped_storage()
            except (RuntimeError, NotImplementedError):   # tensors without storage (some subclasses)
                continue
            self._see_storage(st, u, category)

    def _see_storage(self, st, t, category):
        raise NotImplementedError("a backend says how it sees a storage: use track(), not Tracker()")

    def _change(self, serial, delta, t=None):
        """One event: storage `serial` gained (delta > 0) or lost bytes."""
        self._serials.append(serial)
        self._deltas.append(delta)
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live

    def _relabel(self, serial, category_index):
        if self._label[serial] != category_index:
            self._label[serial] = category_index
            self._version += 1

    # ---- categories -----------------------------------------------------------------------
    def label(self, obj, category):
        """Count every tensor in `obj` (tensor, module, optimizer, list/dict, HF cache) as `category`."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        for t in tensors(obj):
            self._see(t, category)

    def mark(self, text):
        """Put a named mark on the timeline at this moment."""
        self.marks.append((len(self._serials), str(text)))

    def _push(self, category):
        self._phase.append(category)

    def _pop(self):
        if len(self._phase) > 1:
            self._phase.pop()

    def _register(self, obj):
        """Count what `obj` holds; hooks that name what it makes (removed on exit: no reference stays)."""
        if isinstance(obj, torch.nn.Module):
            self.label(list(obj.parameters()) + list(obj.buffers()), "parameters")
            self.label([p.grad for p in obj.parameters() if p.grad is not None], "gradients")
            self._hooks.append(obj.register_forward_pre_hook(self._forward_pre))
            self._hooks.append(obj.register_forward_hook(self._forward_post))
            self._follow_grads(obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for g in obj.param_groups for p in g["params"]]
            self.label(params, "parameters")
            self.label(obj.state, "optimizer")
            self._follow_grads(params)
            self._hooks.append(obj.register_step_pre_hook(self._step_pre))
            self._hooks.append(obj.register_step_post_hook(self._step_post))
        else:                                # tensors, containers: nn.Parameters count as parameters
            found = list(tensors(obj))
            params = [t for t in found if isinstance(t, torch.nn.Parameter)]
            grads = [p.grad for p in params if p.grad is not None]
            taken = {id(t) for t in params + grads}
            self.label([t for t in found if id(t) not in taken], "other")
            self.label(params, "parameters")
            self.label(grads, "gradients")
            self._watch_grads(params)

    def _watch_grads(self, params):
        """Parameters passed in as tensors: no forward of theirs says when a backward runs, so each has a hook
        that labels its .grad as it is accumulated."""
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_accumulated))

    def _grad_accumulated(self, param):
        self._see(param.grad, "gradients")

    def _follow_grads(self, params):
        """Parameters whose .grad `_label_grads` labels (each once: a model and its optimizer share them)."""
        known = {id(p) for p in self._grad_params}
        self._grad_params += [p for p in params if p.requires_grad and id(p) not in known]

    def _label_grads(self):
        """Label the .grad of the parameters of the modules and optimizers passed in: at the end of each
        backward, before each optimizer step, when the block ends. The latest label is the storage's
        category for its whole life, so a gradient born in backward is a gradient from its birth."""
        for p in self._grad_params:
            if p.grad is not None:
                self._see(p.grad, "gradients")

    # Whatever any module's forward creates is an activation: also the forward that activation
    # checkpointing re-runs during backward. Global hooks, so that submodules count too (a backend that
    # follows module calls its own way sets module_hooks = False).
    module_hooks = True

    def _module_pre(self, module, args):
        self._push(ACTIVATIONS)

    def _module_post(self, module, args, out):
        self._pop()

    def _forward_pre(self, module, args):
        self.mark("forward")

    def _forward_post(self, module, args, out):
        self.mark("forward end")
        if isinstance(out, dict):            # transformers' ModelOutput: its KV cache is a cache
            for key, value in out.items():   # items(), not out.get("past_key_values"): no deprecation warning
                if key in ("cache", "past_key_values") and value is not None and not saved_for_backward(value):
                    self.label(value, "kv_cache")

    def _backward_started(self):
        self.mark("backward")

    def _backward_ended(self):
        self._label_grads()
        self._grads_labelled = True

    def _step_pre(self, optimizer, args, kwargs):
        if not self._grads_labelled:         # a backward that did not go through torch.autograd.backward
            self._label_grads()
        self._grads_labelled = False
        self._push(OTHER)
        self.mark("step")

    def _step_post(self, optimizer, args, kwargs):
        self._pop()
        for state in optimizer.state.values():       # {param: {"exp_avg": tensor, "step": tensor}}, once a step
            for value in state.values() if isinstance(state, dict) else (state,):
                if isinstance(value, torch.Tensor):
                    self._see(value, "optimizer")
                elif not isinstance(value, (int, float, bool)):
                    self.label(value, "optimizer")
        self.mark("step end")

    # ---- the block ------------------------------------------------------------------------
    def __enter__(self):
        if self._entered:
            raise RuntimeError("a track() report can be entered once; start a new lk.track(...) for another block")
        self._entered = True
        self.counts_fake = fake_mode_active()
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
            if self.module_hooks:
                self._hooks.append(register_module_forward_pre_hook(self._module_pre))
                self._hooks.append(register_module_forward_hook(self._module_post, always_call=True))
            # torch warns that a compiled module's global hooks fire once more (for the OptimizedModule):
            # ours only push and pop a phase, so that is harmless; that one warning is ignored in the block.
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            self.start = self.live
            self.mark("start")
            if any(not t.nests for t in ACTIVE) or (not self.nests and ACTIVE):
                raise RuntimeError("lk.track(backend='profiler') does not nest with another lk.track() (one torch "
                                   "profiler at a time, and it would count the other tracker's work): end the "
                                   "outer block first")
            self._start_counting()
            if not ACTIVE:
                follow_autograd()
            ACTIVE.append(self)
            if self.cuda is not None and self.snapshot:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            return self._enter_mode()
        except BaseException:
            self.budget = limit
            self._close()
            raise

    def __exit__(self, kind, exc, tb):
        self._label_grads()
        self._exit_mode(kind, exc, tb)
        self._close()
        self.mark("end")
        if kind is None:
            self._check_block()
        return False

    def _start_counting(self):
        """The backend starts seeing allocations (after the objects passed in are counted)."""

    def _stop_counting(self):
        """The backend stops; safe to call when `_start_counting` never ran, or twice."""

    def _enter_mode(self):
        return self

    def _exit_mode(self, kind, exc, tb):
        pass

    def _check_block(self):
        """After a block that ended without an error: raise if what was counted cannot be trusted."""

    def _close(self):
        """Remove every hook, stop counting frees; keep what was measured. Safe to call twice."""
        if self in ACTIVE:
            ACTIVE.remove(self)
            if not ACTIVE:
                for name, original in AUTOGRAD.items():
                    setattr(torch.autograd, name, original)
                AUTOGRAD.clear()
        for h in self._hooks:
            h.remove()
        self._hooks, self._grad_params = [], []
        self._closed = True
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None
        self._stop_counting()
        if self.cuda is not None and "peak_allocated" not in self.cuda:
            torch.cuda.synchronize()
            self.cuda.update(peak_allocated=torch.cuda.max_memory_allocated(),
                             peak_reserved=torch.cuda.max_memory_reserved())
            if self.snapshot:
                torch.cuda.memory._dump_snapshot(str(self.snapshot))
                torch.cuda.memory._record_memory_history(enabled=None)

    # ---- the report -----------------------------------------------------------------------
    @property
    def events(self):
        """The allocation trace: [(storage serial, +bytes allocated or -bytes freed)], in order."""
        return list(zip(self._serials, self._deltas))

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
            out = {c: sums[:, i] for c, i in CATEGORY_INDEX.items()}
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


def follow_autograd():
    """Wrap `torch.autograd.backward` (what `loss.backward()` calls) and `torch.autograd.grad` while trackers are
    in their blocks: when one starts, each tracker marks "backward"; when a backward ends, each labels the .grad
    its parameters now hold. Two calls per backward, where a hook per parameter costs one call per parameter
    and a hook on each forward's output a registration per forward."""
    for name in ("backward", "grad"):
        AUTOGRAD[name] = original = getattr(torch.autograd, name)
        setattr(torch.autograd, name, _followed(original, labels=name == "backward"))


def _followed(original, labels):
    @functools.wraps(original)
    def followed(*args, **kwargs):
        for tracker in list(ACTIVE):
            tracker._backward_started()
        try:
            return original(*args, **kwargs)
        finally:
            if labels:
                for tracker in list(ACTIVE):
                    tracker._backward_ended()
    return followed
