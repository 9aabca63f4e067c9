"""Survive an out-of-memory error, pretend the device is smaller, and say what a section needs."""
from __future__ import annotations

import contextlib
import gc
import itertools
import re
import sys
import traceback
import weakref

import torch

from .device import has
from .memory import track
from .memory.walk import frame_locals, objects, tensors
from .units import fmt_bytes, parse_bytes

__all__ = ["oom_guard", "budget", "free", "requires"]

# What running out of memory looks like when it is not a torch.OutOfMemoryError: the CPU allocator
# ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ..."; "not enough memory" on
# Windows) and MPS ("MPS backend out of memory") raise a plain RuntimeError.
_OOM_TEXT = re.compile(r"can't allocate memory|not enough memory|out of memory", re.IGNORECASE)


def _is_oom(kind, exc):
    if issubclass(kind, torch.OutOfMemoryError):
        return True
    return issubclass(kind, RuntimeError) and bool(_OOM_TEXT.search(str(exc)))


class oom_guard(contextlib.AbstractContextManager):
    """Catch an out-of-memory error in the block, free what its frames held, report, go on.

    objs: the models, optimizers or tensors the block trains, or lists and dicts of them (each held
    weakly: `del model` after `oom_guard([model, opt])` frees the model). After an OOM in
    backward or `step()` some of their parameters hold partial `.grad`s that the next step would
    silently add to: the guard sets them to None (`.cleared` counts them). Without objs it cannot
    know them, and the message says so.
    Caught: `torch.OutOfMemoryError` and a RuntimeError saying the allocator failed (CPU, MPS).
    After the block: `.oom` is True if it ran out of memory, `.message` says what happened. The
    same guard can be entered again; each block starts with `.oom` False.
    A name in the block's scope bound to a tensor with an autograd graph (`loss = model(...).loss` before
    a backward that ran out), or to a model output, list or dict holding one (`out = model(...)`), keeps
    everything forward saved alive: the guard cannot unbind it, so its message (and `.graphs`) names it
    and says to `del` it. (Reading those names leaves nothing behind: see `memory.walk.frame_locals`.)
    objs may be iterators (`model.parameters()`): they are read once, here.
    """

    def __init__(self, *objs, quiet=False):
        self.quiet, self.oom, self.message, self.cleared, self.graphs = quiet, False, None, 0, []
        self._objs = [ref for o in objects(objs, "oom_guard") for ref in _weak_refs(o)]

    def __enter__(self):
        self.oom, self.message, self.cleared, self.graphs = False, None, 0, []
        return self

    def __exit__(self, kind, exc, tb):
        if kind is None or not _is_oom(kind, exc):
            return False
        lines = [line for line in str(exc).splitlines() if line.strip()]
        self.oom, self.message = True, (lines[0] if lines else f"{kind.__name__} (no message)")
        in_training = any(f.f_code.co_name in ("backward", "run_backward", "step")
                          for f, _ in traceback.walk_tb(tb))
        traceback.clear_frames(tb)            # the frames' locals are what keep the tensors alive
        exc.__traceback__ = None
        sys.last_value = sys.last_traceback = None
        del exc, tb
        grads = self._clear_grads(in_training)
        self.graphs = _graphs_held(sys._getframe(1))
        free()
        graphs = ""
        if self.graphs:
            names = ", ".join(f"`{n}`" for n in self.graphs)
            graphs = (f"{names} still {'holds its' if len(self.graphs) == 1 else 'hold their'} autograd graph "
                      f"(every tensor forward saved for backward stays alive): `del {', '.join(self.graphs)}` "
                      f"after this block, or call `.backward()` on the expression without naming it "
                      f"(`model(...).loss.backward()`).")
        if not self.quiet:
            where = (f"; CUDA allocated now {fmt_bytes(torch.cuda.memory_allocated())}"
                     if torch.cuda.is_available() else "")
            said = " ".join(x for x in (grads, graphs) if x)
            print(f"OutOfMemoryError caught: {self.message}{where}. {said + ' ' if said else ''}The kernel goes on.")
        return True

    def _clear_grads(self, in_training):
        """Drop the .grad of every parameter of the objects given; say what was done."""
        if not self._objs:
            return ("It stopped in backward or step(), so parameters may hold partial .grads: "
                    "call opt.zero_grad(), or pass them, oom_guard(model, opt), to clear them."
                    if in_training else "")
        for ref in self._objs:
            obj = ref()
            if obj is None:                   # deleted since: nothing of it to clear
                continue
            if isinstance(obj, torch.optim.Optimizer):
                params = [p for g in obj.param_groups for p in g["params"]]
            else:
                params = [t for t in tensors(obj) if isinstance(t, torch.Tensor)]
            for p in params:
                if p.grad is not None:
                    p.grad = None
                    self.cleared += 1
        return f"Cleared the partial .grad of {self.cleared} tensors." if self.cleared else ""


def _graphs_held(frame):
    """Names in the frame running the with-block bound to something that keeps an autograd graph alive.
    IPython's `In`/`Out` history and private names are left out."""
    return sorted(n for n, v in frame_locals(frame).items()
                  if not n.startswith("_") and n not in ("In", "Out") and _holds_graph(v))


def _holds_graph(value, depth=2):
    """A tensor with a grad_fn, or a list, tuple or dict (a transformers ModelOutput) holding one, two levels
    deep at most and among its first 64 items (a notebook's globals hold long lists of numbers)."""
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None
    if depth and isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        return any(_holds_graph(v, depth - 1) for v in itertools.islice(items, 64))
    return False


def _weak_refs(obj):
    """Weak references to `obj`, or to each model, optimizer or tensor a list, tuple or dict of them holds:
    a reference to the container would keep its contents alive."""
    if isinstance(obj, (list, tuple, set)):
        return [ref for item in obj for ref in _weak_refs(item)]
    if isinstance(obj, dict):
        return [ref for item in obj.values() for ref in _weak_refs(item)]
    try:
        return [weakref.ref(obj)]
    except TypeError:                     # a number or a string inside a container: nothing to clear
        return []


@contextlib.contextmanager
def budget(size, *objs):
    """Pretend the device holds only `size` bytes ("2 GiB", or a whole number of bytes).

    CUDA: a per-process memory fraction, so the caching allocator raises a real OOM.
    CPU (and fake/meta): a `track()` over `objs` (modules, optimizers, tensors counted from the start)
    that raises `torch.OutOfMemoryError` once live bytes pass the budget. Yields the tracker.
    If what `objs` already hold passes the budget, the OOM says so before the block runs, and
    nothing stays registered.
    """
    limit = parse_bytes(size, "size")
    if torch.cuda.is_available():
        held = torch.cuda.memory_allocated()
        if held > limit:
            raise torch.OutOfMemoryError(f"budget {fmt_bytes(limit)} exceeded before the block ran: "
                                         f"CUDA already holds {fmt_bytes(held)}")
        total = torch.cuda.get_device_properties(0).total_memory
        # The fraction is checked only when the allocator reserves a new segment: blocks it already
        # caches would be handed out past the budget, so return them first.
        torch.cuda.empty_cache()
        before = torch.cuda.get_per_process_memory_fraction()     # a fence around the notebook (make test-gpu) stays
        torch.cuda.set_per_process_memory_fraction(min(before, limit / total))
        try:
            with track(*objs) as mem:
                yield mem
        finally:
            torch.cuda.set_per_process_memory_fraction(before)
    else:
        with track(*objs, budget=limit) as mem:
            yield mem


def free():
    """Return memory between experiments: collect garbage, empty the CUDA cache, reset its peak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def requires(*features, skipped="this section"):
    """True if every feature in `features` (see `lk.has`) is present; else print what is skipped and why."""
    if not features:
        raise ValueError("requires needs at least one feature name, like requires('cuda')")
    missing = [f for f in features if not has(f)]
    if missing:
        print(f"Skipped: {skipped}. It needs {', '.join(missing)}, which this machine does not have.")
    return not missing
