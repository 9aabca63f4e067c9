"""Run a step under `torch.profiler` and read the profile: top operators, a categorised memory timeline,
time and memory per `record_function` range, and which line of Python called an operator.

    prof = lk.profiling.run(step, trace="build/step.json")      # one call of step(), profiled
    prof.top("time"), prof.top("memory"), prof.top("count")     # rows: name, calls, times, bytes
    tl = prof.memory_timeline()                                  # {category: bytes over time}, "total", "t_us"
    prof.peak_parts()                                            # the breakdown at the peak, lk.track's names
    prof.ranges(["forward", "backward", "step"])                 # time, peak and net bytes of each range
    prof.sources("aten::item")                                   # {python frame: calls}: who called it
    prof.live_at_peak()                                          # [(profiler category, bytes)] of each tensor

Everything here counts what the profiler recorded (calls, bytes, its own timestamps); nothing is
typed in. The categorised timeline is PyTorch's own (`torch.profiler._memory_profiler`, the code
behind `profile.export_memory_timeline`): it infers parameters, gradients, optimizer state and
activations from the data flow between operators, while `lk.track` labels tensors from hooks; at the
peak of a training step the two agree (notebook 12 and tests/test_profiling.py check it within 1%).
Its categories map to `lk.track`'s: PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION map one to one;
INPUT, TEMPORARY, AUTOGRAD_DETAIL and uncategorised memory count as "other".

The profiler's own notes on file descriptor 2 (kineto's "STAGE:"/"USDT:" lines, and on a CUDA build of torch
without a GPU its one-time "gpuGetDeviceCount failed") are dropped while it runs (`without_profiler_notes`),
so a notebook cell stays free of stderr, and so is torch 2.11's warning that a profile "clears events at the end
of each cycle" (a note for a profile object started twice, which it also gives at the first start). CUDA
activities are asked for only where a GPU is available.
"""
from __future__ import annotations

import collections
import pathlib
import warnings

import numpy as np
import torch

from .checks import count
from .memory import CATEGORIES
from .memory.profiler import without_profiler_notes

__all__ = ["run", "Profile", "PROFILER_CATEGORIES", "SYNC_OPS"]

# torch.profiler._memory_profiler.Category name -> lk.track's category
PROFILER_CATEGORIES = {"PARAMETER": "parameters", "GRADIENT": "gradients", "OPTIMIZER_STATE": "optimizer",
                       "ACTIVATION": "activations", "INPUT": "other", "TEMPORARY": "other",
                       "AUTOGRAD_DETAIL": "other", None: "other"}
# Operators that can make the host wait for the device: each one synchronises when its input lives on a
# GPU (aten::item on a CPU tensor, e.g. AdamW's step counter, waits for nothing; on a CPU nothing waits).
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaEventSynchronize")
# torch.profiler's note when a profile object starts a second cycle; torch 2.11 prints it at the first start too
CLEARS_EVENTS = "Warning: Profiler clears events at the end of each cycle"
_LIBRARY = ("nn.Module:", "torch/", "transformers/", "triton/", "accelerate/", "peft/", "labkit/", "<built-in")
_BY = {"time": "self_time_s", "memory": "self_bytes", "count": "calls"}


def run(fn, *, steps=1, trace=None, memory=True, shapes=True, stack=True):
    """Call fn() `steps` times under torch.profiler and return a `Profile`.

    memory, shapes, stack: the profiler's profile_memory, record_shapes and with_stack (the memory
    timeline needs all three; `sources()` needs stack). trace: a path for the Chrome trace (open it
    at https://ui.perfetto.dev); its folder is created."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (a step to profile), got {type(fn).__name__}")
    steps = count("steps", steps)
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, profile_memory=memory, record_shapes=shapes, with_stack=stack)
    with without_profiler_notes():
        with warnings.catch_warnings():        # torch 2.11 warns at any first start, not only at a reuse
            warnings.filterwarnings("ignore", message=CLEARS_EVENTS)
            prof.__enter__()
        try:
            for _ in range(steps):
                fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        finally:
            prof.__exit__(None, None, None)
    path = None
    if trace is not None:
        path = pathlib.Path(trace)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
    return Profile(prof, path, memory=memory, shapes=shapes, stack=stack)


class Profile:
    """What `run()` recorded. `prof` is the torch.profiler.profile object itself."""

    def __init__(self, prof, trace=None, memory=True, shapes=True, stack=True):
        self.prof, self.trace = prof, trace
        self._flags = {"memory": memory, "shapes": shapes, "stack": stack}
        self._timeline = None
        self._tree = None
        self._averages = None
        self.device = "cuda" if torch.cuda.is_available() else "cpu"

    # ---- operators -----------------------------------------------------------------------------
    def top(self, by="time", n=10):
        """The n operators with the most self time, self memory (bytes allocated minus freed by the
        operator itself, on this device) or calls: [{name, calls, self_time_s, total_time_s, self_bytes}].
        Operators only, on every torch: with stack=True torch 2.13's averages also hold the Python tracer's
        functions and modules (pytorch/pytorch#178168; 2.11's hold none, and #188631 drops them again by
        default), which are left out here. Which Python line called an operator: `sources(name)`."""
        if by not in _BY:
            raise ValueError(f"by must be one of {tuple(_BY)}, got {by!r}")
        n = count("n", n)
        cuda = self.device == "cuda"
        rows = []
        for e in self._key_averages():
            if _is_python(e.key):
                continue
            rows.append({"name": e.key, "calls": e.count,
                         "self_time_s": (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6,
                         "total_time_s": (e.device_time_total if cuda else e.cpu_time_total) / 1e6,
                         "self_bytes": e.self_device_memory_usage if cuda else e.self_cpu_memory_usage})
        rows.sort(key=lambda r: -r[_BY[by]])
        return rows[:n]

    def calls(self, name):
        """How many times an operator (or record_function range) named `name` ran."""
        if not isinstance(name, str):
            raise TypeError(f"name must be an operator or range name, got {name!r}")
        self._key_averages()
        return self._counts.get(name, 0)

    def _key_averages(self):
        """The profiler's per-name totals, computed once (each call of key_averages() walks every event)."""
        if self._averages is None:
            self._averages = list(self.prof.key_averages())
            self._counts = {}
            for e in self._averages:
                self._counts[e.key] = self._counts.get(e.key, 0) + e.count
        return self._averages

    # ---- the event tree (absolute timestamps, parents, Python frames) ---------------------------
    def _events(self):
        if self._tree is None:
            out, stack = [], list(self.prof.profiler.kineto_results.experimental_event_tree())
            while stack:
                e = stack.pop()
                stack.extend(e.children)
                out.append(e)
            self._tree = out
        return self._tree

    def sources(self, name):
        """Which Python code called operator `name`: {(innermost frame, innermost frame outside the
        libraries): calls}, most calls first. Frames read like "file.py(12): function". Needs stack=True."""
        if not self._flags["stack"]:
            raise ValueError("sources() needs the Python frames: profile with stack=True")
        from torch._C._profiler import _EventType
        found = collections.Counter()
        for e in self._events():
            if e.name != name:
                continue
            inner = user = None
            p = e.parent
            while p is not None and user is None:
                if p.tag == _EventType.PyCall:
                    inner = inner or p.name
                    if not any(lib in p.name.split("(")[0] or p.name.startswith(lib) for lib in _LIBRARY):
                        user = p.name
                p = p.parent
            found[(inner, user)] += 1
        return dict(found.most_common())

    # ---- memory ----------------------------------------------------------------------------------
    def memory_timeline(self, raw=False):
        """Live bytes on this device by category after every moment the profiler saw memory change:
        {category: int64 array, "total": ..., "t_us": timestamps}. Categories are lk.track's
        (CATEGORIES), or the profiler's own names with raw=True. Needs memory, shapes and stack."""
        if not all(self._flags.values()):
            raise ValueError(f"the categorised timeline needs memory=True, shapes=True, stack=True, got {self._flags}")
        if self._timeline is None:
            from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline
            times, sizes = _coalesce(MemoryProfileTimeline(self.prof._memory_profile()), self.device)
            if not times:
                raise ValueError(f"the profile holds no memory events on {self.device}: did the step allocate there?")
            sizes = np.asarray(sizes, dtype=np.int64).reshape(len(times), -1)
            own = {(c.name if c is not None else None): sizes[:, i + 1] for c, i in _CATEGORY_TO_INDEX.items()}
            self._timeline = (np.asarray(times, dtype=np.int64), own)
        times, own = self._timeline
        if raw:
            out = {str(k): v for k, v in own.items()}
        else:
            out = {c: np.zeros(len(times), dtype=np.int64) for c in CATEGORIES}
            for k, v in own.items():
                out[PROFILER_CATEGORIES[k]] = out[PROFILER_CATEGORIES[k]] + v
        out["total"] = sum(own.values()) if own else np.zeros(len(times), dtype=np.int64)
        out["t_us"] = times
        return out

    @property
    def peak(self):
        """The most bytes live at once in the categorised timeline."""
        return int(self.memory_timeline()["total"].max())

    def peak_parts(self, raw=False):
        """The breakdown by category at the moment of the peak."""
        tl = self.memory_timeline(raw=raw)
        i = int(np.argmax(tl["total"]))
        return {c: int(v[i]) for c, v in tl.items() if c not in ("total", "t_us")}

    def live_at_peak(self):
        """The tensors live at the moment of the peak, largest first: [(profiler category name or None,
        bytes)], replaying the profiler's memory events exactly as its categorised timeline sums them."""
        from torch.profiler._memory_profiler import Action, MemoryProfileTimeline, TensorKey
        peak_index = int(np.argmax(self.memory_timeline()["total"]))
        timeline = MemoryProfileTimeline(self.prof._memory_profile())
        device = _timeline_device({key.device for _, _, (key, _), _ in timeline.timeline}, self.device)
        live, times = {}, []                                     # key -> (version, bytes)
        for t, action, (key, version), numbytes in timeline.timeline:
            if key.device != device:
                continue
            t = t if t == -1 else int(t / 1000)                 # the timeline's microseconds, as in torch
            if not times or t != times[-1]:
                times.append(t)
                if len(times) - 1 > peak_index:                 # the peak's moment is complete
                    break
            if action in (Action.PREEXISTING, Action.CREATE):
                live[key] = (version, numbytes)
            elif action == Action.INCREMENT_VERSION:
                live[key] = (version + 1, numbytes)
            elif action == Action.DESTROY:
                live.pop(key, None)
        out = []
        for key, (version, numbytes) in live.items():
            category = timeline.categories.get(key, version) if isinstance(key, TensorKey) else None
            out.append((category.name if category is not None else None, int(numbytes)))
        return sorted(out, key=lambda x: -x[1])

    def ranges(self, names):
        """For each record_function range in `names`: calls, time_s (summed over calls, host clock),
        start_us (its first start, on memory_timeline()'s clock), peak_bytes (the most live bytes while
        it ran) and net_bytes (live at its end minus its start). Host-side ranges only: on a GPU the
        profiler also draws each range on the device's timeline, which is not counted again."""
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"names must be a list of range names, got {names!r}")
        from torch._C._profiler import _EventType
        tl = self.memory_timeline() if all(self._flags.values()) else None
        out = {}
        for name in names:
            spans = [(e.start_time_ns, e.end_time_ns) for e in self._events()
                     if e.name == name and e.tag == _EventType.TorchOp]
            if not spans:
                raise ValueError(f"no range named {name!r} in the profile (record_function({name!r}) around it?)")
            row = {"calls": len(spans), "time_s": sum(b - a for a, b in spans) / 1e9,
                   "start_us": min(a for a, _ in spans) // 1000}      # the clock of memory_timeline()["t_us"]
            if tl is not None:
                t, total = tl["t_us"], tl["total"]
                peaks, net = [], 0
                for a, b in spans:
                    i0 = max(int(np.searchsorted(t, a // 1000, "right")) - 1, 0)   # live just before it starts
                    i1 = max(int(np.searchsorted(t, b // 1000, "right")) - 1, 0)   # live at its end
                    peaks.append(int(total[i0:i1 + 1].max()))
                    net += int(total[i1] - total[i0])
                row.update(peak_bytes=max(peaks), net_bytes=net)
            out[name] = row
        return out


def _coalesce(timeline, device):
    """(times, sizes by category) of a MemoryProfileTimeline's events on `device`: torch's own
    `_coalesce_timeline`, given the device exactly as its events carry it (see `_timeline_device`)."""
    seen = {key.device for _, _, (key, _), _ in timeline.timeline}
    return timeline._coalesce_timeline(str(_timeline_device(seen, device)))


def _timeline_device(seen, device):
    """The device among `seen` (those of a profile's memory events) that `device` names.

    torch's `_coalesce_timeline` keeps events whose device equals its argument, and torch.device("cuda")
    != torch.device("cuda:0"), while the profiler records CUDA allocations with their index: "cuda"
    alone matched nothing (an empty timeline). A name without an index means the current device."""
    want = torch.device(device)
    index = want.index
    if index is None and want.type == "cuda":
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
    for d in sorted(seen, key=str):
        if d.type == want.type and (d.index is None or index is None or d.index == index):
            return d
    return want


def _is_python(name):
    """A Python function or module event of the profiler's Python tracer, not an operator."""
    return ".py(" in name or name.startswith(("<built-in", "nn.Module:", "nn.Module: ", "<frozen"))
