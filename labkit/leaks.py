"""Find memory that a training or eval step leaves behind: what survives each step and grows, and who holds it.

`find(step, steps=4)` runs `step()` a few times (after `warmup` untracked runs, which create what
legitimately lives on: optimizer state, caches). While a step runs, a `TorchDispatchMode` notes every new
tensor storage with the line of your code that made it, and a saved-tensors hook notes what autograd
saves for backward. After each step it counts what the step left alive, then runs `gc.collect()`
(automatic collection is paused meanwhile) and counts again: bytes that only the collector freed were
held by reference cycles. At the end, each group of survivors (by the line that made it) is traced back to
what holds it: a chain of `gc.get_referrers` up to a global name or a local variable of a running function
(the one that called `find`, say); survivors that no Python
object holds but autograd saved are reported as kept alive by an autograd graph, with the tensor whose
graph it is.

    report = lk.leaks.find(eval_step, steps=4)
    report.growth_per_step      # bytes (after gc.collect()); 0 for a correct loop
    report.survivors            # [Survivor(line, bytes_per_step, holder, ...)], largest first; a line whose
                                # survivors all come from one step (the state a step hands to the next) is
                                # held once, 0 per step
    report.cycle_bytes_per_step # freed only by gc.collect()

What it finds, e.g. the three usual leaks: intermediates kept alive (a loss summed as a tensor, outputs kept in
a list: each holds its step's autograd graph), a cache that grows in a loop (a dict keyed by something new each
step), and an RNN whose hidden state is carried to the next step without `.detach()` (each step's graph hangs
on the previous one's); notebook 05's leak clinic plants each and reads its report.

Limits: tensors made by other threads are not seen (a dispatch mode is per thread); a holder chain is
found through Python objects only (C++ holders other than autograd's saved tensors show as "unknown").
"""
from __future__ import annotations

import functools
import gc
import inspect
import os
import sys
import types
import weakref
from dataclasses import dataclass, field
from operator import attrgetter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .checks import count
from .memory.dispatch import input_storages
from .memory.walk import frame_locals
from .units import fmt_bytes

__all__ = ["find", "LeakReport", "Survivor", "holders"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SKIP = (os.path.dirname(torch.__file__), _HERE, os.path.dirname(os.__file__), "site-packages", "<frozen")


def _user_line():
    """The innermost frame outside torch, labkit, the standard library and installed packages."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not any(s in name for s in _SKIP):
            return f"{os.path.basename(name)}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "<unknown>"


class _Born(TorchDispatchMode):
    """Notes each new storage: bytes, the line that made it, a weak reference to its first tensor."""

    def __init__(self, book, step):
        super().__init__()
        self.book, self.step = book, step

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                try:
                    st = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                key = id(st)
                entry = self.book.live.get(key)
                if entry is not None:                          # a view or alias: one more object that may be held
                    refs = entry[2]
                    if len(refs) < 4 or refs[0]() is None:
                        try:
                            refs.append(weakref.ref(t))
                        except TypeError:
                            pass
                        if len(refs) > 4:
                            refs.pop(0)
                elif st.nbytes() > 0 and key not in input_storages(args, kwargs):
                    self.book.add(key, st, t, self.step)      # new (not a view of an input, not in place)
        return out


class _Book:
    def __init__(self):
        self.live = {}        # id(storage) -> [nbytes, line, weakref(tensor), step, storage weakref]
        self.saved = set()    # ids of storages autograd saved for backward

    def add(self, key, st, t, step):
        try:
            trefs = [weakref.ref(t)]     # the tensors seen on this storage (views too), weakly
        except TypeError:
            trefs = []
        self.live[key] = [st.nbytes(), _user_line(), trefs, step,
                          weakref.ref(st, functools.partial(self._gone, key))]

    def _gone(self, key, ref):       # the storage's weakref callback: it was freed
        entry = self.live.get(key)
        if entry is not None and entry[4] is ref:
            del self.live[key]

    _gone.runs_on_its_own = True     # runs when a storage dies, whatever code runs then (see labkit.exercise)

    def bytes(self):
        return sum(e[0] for e in self.live.values())

    def pack(self, t):
        try:
            self.saved.add(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            pass
        # Returning `t` itself would make an output's graph hold the output's own Python object: a cycle
        # through C++ that gc cannot break. A detached alias shares the storage and adds no bytes.
        return t.detach()


def _unpack(t):
    """The saved-tensors hook's unpack: the detached alias `pack` returned is the tensor autograd reads."""
    return t


def _is_leaf_ref(ref):
    """Sort key: tensors with a grad_fn (graph roots) before leaves."""
    return ref().grad_fn is None


@dataclass
class Survivor:
    """Storages made on one line that outlived their step."""
    line: str
    bytes_per_step: float          # what the line adds per tracked step; 0 when its survivors come from one step
    count: int
    steps: int                     # in how many tracked steps this line left something alive
    holder: str                    # what keeps it alive
    saved_for_backward: bool       # autograd saved it (kept alive by a graph when nothing else holds it)
    bytes: int = 0                 # bytes alive from this line at the end

    def __str__(self):
        if self.steps == 1:        # one step's state, replaced by the next: held, not growing
            return (f"{fmt_bytes(self.bytes)} once (left by one step, not growth) from {self.line} ({self.count} "
                    f"storages): held by {self.holder}")
        return (f"{fmt_bytes(int(self.bytes_per_step))}/step from {self.line} ({self.count} storages, "
                f"{self.steps} steps): held by {self.holder}")


@dataclass
class LeakReport:
    """What `find` saw: bytes alive after each step, growth, survivors by line, cycle bytes."""
    live_after: list               # bytes alive after each tracked step (after gc.collect())
    cycle_bytes: list              # per step: bytes freed only by gc.collect()
    survivors: list = field(default_factory=list)

    @property
    def growth_per_step(self):
        """Mean growth of live bytes per step (0 for a loop that leaves nothing behind)."""
        if len(self.live_after) < 2:
            return self.live_after[0] if self.live_after else 0
        return (self.live_after[-1] - self.live_after[0]) / (len(self.live_after) - 1)

    @property
    def grows(self):
        """Live bytes went up after every tracked step."""
        return len(self.live_after) > 1 and all(b > a for a, b in zip(self.live_after, self.live_after[1:]))

    @property
    def cycle_bytes_per_step(self):
        return sum(self.cycle_bytes) / len(self.cycle_bytes) if self.cycle_bytes else 0

    def __str__(self):
        lines = [f"growth {fmt_bytes(int(self.growth_per_step))}/step, live after each step: "
                 + ", ".join(fmt_bytes(b) for b in self.live_after),
                 f"freed only by gc.collect() (reference cycles): {fmt_bytes(int(self.cycle_bytes_per_step))}/step"]
        lines += [f"  {s}" for s in self.survivors] or ["  nothing survives its step"]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):        # IPython shows a report as its text
        printer.text(str(self))


def find(step, steps=4, warmup=1):
    """Run `step()` `warmup` + `steps` times; report what each tracked step leaves alive and what holds it."""
    if not callable(step):
        raise TypeError(f"step must be a callable taking no arguments, got {type(step).__name__}")
    steps, warmup = count("steps", steps, 2), count("warmup", warmup, 0)
    for _ in range(warmup):           # under the same hooks: one-time set-up is not counted as a leak
        scratch = _Book()
        with torch.autograd.graph.saved_tensors_hooks(scratch.pack, _unpack), _Born(scratch, -1):
            step()
    gc.collect()
    book, live_after, cycles = _Book(), [], []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for k in range(steps):
            with torch.autograd.graph.saved_tensors_hooks(book.pack, _unpack), _Born(book, k):
                step()
            before = book.bytes()
            gc.collect()
            after = book.bytes()
            cycles.append(before - after)
            live_after.append(after)
        survivors = _survivors(book, steps)
    finally:
        if was_enabled:
            gc.enable()
    return LeakReport(live_after, cycles, survivors)


def _survivors(book, steps):
    groups = {}
    for key, (nbytes, line, trefs, k, _) in list(book.live.items()):
        g = groups.setdefault(line, {"bytes": 0, "count": 0, "steps": set(), "refs": [], "saved": False})
        g["bytes"] += nbytes
        g["count"] += 1
        g["steps"].add(k)
        g["saved"] |= key in book.saved
        g["refs"] += trefs                    # weak: the search must not find our own lists
    graph_holder = _graph_holder(book)
    out = []
    for line, g in groups.items():
        holder = None
        # tensors whose Python object still lives (most saved in a graph do not); graph roots first
        alive = [r for r in g["refs"] if r() is not None]
        alive.sort(key=_is_leaf_ref)
        for tref in alive[:8]:
            t = tref()
            holder = holders(t)
            if holder and g["saved"] and t.grad_fn is not None:
                holder = f"the autograd graph of {holder}"
            del t
            if holder:
                break
        if holder is None and g["saved"]:
            holder = "an autograd graph" + (f" reachable from {graph_holder}" if graph_holder else "")
        per_step = g["bytes"] / steps if len(g["steps"]) > 1 else 0   # one step's survivors: no growth
        out.append(Survivor(line, per_step, g["count"], len(g["steps"]), holder or "unknown (no Python referrer)",
                            g["saved"], g["bytes"]))
    out.sort(key=attrgetter("bytes_per_step", "bytes"), reverse=True)
    return out


def _graph_holder(book):
    """Who holds a surviving tensor with a grad_fn (its graph keeps the saved tensors alive)."""
    for nbytes, line, trefs, k, _ in list(book.live.values()):
        for tref in trefs:
            t = tref()
            if t is not None and t.grad_fn is not None:
                chain = holders(t)
                if chain:
                    return chain
    return None


def _globals_names():
    """id(module globals dict) -> module name, for naming roots."""
    out = {}
    for name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None)
        if isinstance(d, dict) and (id(d) not in out or name == "__main__"):   # a notebook's globals: __main__
            out[id(d)] = name
    return out


def _stack_locals():
    """id(value) -> "local 'name' in function", for the variables of the functions running now (outside torch,
    labkit and installed packages), innermost first. A running frame is no referrer that gc reports (its
    variables live in the interpreter's frame, not in an object gc walks), so they are looked up here."""
    out = {}
    f = sys._getframe(1)
    while f is not None:
        function = f.f_code.co_flags & inspect.CO_OPTIMIZED      # a module's variables are globals: roots above
        if function and not any(s in f.f_code.co_filename for s in _SKIP):
            for name, value in frame_locals(f).items():
                out.setdefault(id(value), f"local {name!r} in {f.f_code.co_name}")
        f = f.f_back
    return out


def _chain(objs, parents, i):
    """The descriptions of objs[i] and its children down to the object searched for."""
    chain = []
    while i != -1:
        chain.append(_describe(objs[i]))
        i = parents[i]
    return chain


def holders(obj, max_depth=6):
    """A readable chain from a root (a global name, or a local variable of a running function) down to `obj`,
    found with `gc.get_referrers`; None if none.

    e.g. "global 'outputs' in __main__ -> list[4] -> Tensor(2, 8)", "local 'kept' in train -> list[4] ->
    Tensor(2, 8)", or through a closure:
    "global 'callbacks' in __main__ -> list[4] -> function <lambda> -> tuple[1] -> closure cell -> Tensor(...)".
    """
    roots, local = _globals_names(), _stack_locals()
    objs, parents = [obj], [-1]            # breadth-first search upwards, with parent links
    seen = {id(obj)}
    ignore = {id(objs), id(parents), id(seen)}
    level = [0]
    for _ in range(max_depth):
        nxt = []
        for i in level:
            if id(objs[i]) in local:
                return " -> ".join([local[id(objs[i])]] + _chain(objs, parents, i))
            refs = gc.get_referrers(objs[i])
            for r in refs:
                if id(r) in seen or id(r) in ignore or isinstance(r, types.FrameType) or r is refs:
                    continue
                seen.add(id(r))
                if isinstance(r, dict) and id(r) in roots:
                    name = next((k for k, v in r.items() if v is objs[i]), "?")
                    return " -> ".join([f"global {name!r} in {roots[id(r)]}"] + _chain(objs, parents, i))
                objs.append(r)
                parents.append(i)
                nxt.append(len(objs) - 1)
            del refs
        level = nxt
        if not level:
            break
    return None


def _describe(o):
    if isinstance(o, torch.Tensor):
        return f"Tensor{tuple(o.shape)}"
    if isinstance(o, types.FunctionType):
        return f"function {o.__qualname__}"
    if isinstance(o, types.CellType):
        return "closure cell"
    if isinstance(o, (list, tuple, dict, set)):
        return f"{type(o).__name__}[{len(o)}]"
    return type(o).__name__
