"""Replaying an allocation trace through the model: `replay` (bytes over time, peaks, device calls),
`smallest_device` (by bisection), and three synthetic traces, each built so that one setting matters."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..units import MiB
from .caching import Allocator

__all__ = ["Replay", "replay", "smallest_device", "growing_batch", "pinned_holes", "phases"]


@dataclass
class Replay:
    """What replaying a trace did: bytes after every event, peaks, device calls, fragmentation at the peak."""
    conf: str
    allocated: np.ndarray            # after every event
    reserved: np.ndarray
    peak_allocated: int
    peak_reserved: int
    device_mallocs: int
    device_frees: int
    retries: int
    searches: int
    oom_at: int | None               # the event that failed (None: the trace ran)
    largest_free_at_peak: int        # the largest cached block at the reserved peak
    allocator: Allocator = field(repr=False)

    @property
    def ok(self):
        return self.oom_at is None

    @property
    def waste(self):
        """Peak reserved beyond the peak of allocated blocks, as a fraction of the latter."""
        return self.peak_reserved / self.peak_allocated - 1 if self.peak_allocated else 0.0

    @property
    def free_at_peak(self):
        """Cached (reserved, unallocated) bytes at the reserved peak."""
        i = int(np.argmax(self.reserved)) if len(self.reserved) else 0
        return int(self.reserved[i] - self.allocated[i]) if len(self.reserved) else 0

    def snapshot(self):
        return self.allocator.snapshot()


def _events(trace):
    """(key, +bytes) / (key, -bytes) pairs from a list of tuples or a `track()` report."""
    if hasattr(trace, "trace") and not isinstance(trace, (list, tuple)):
        trace = trace.trace
    if not isinstance(trace, (list, tuple)):
        raise TypeError(f"trace must be a list of (key, nbytes, ...) tuples or a track() report, "
                        f"got {type(trace).__name__}")
    for i, ev in enumerate(trace):
        if not isinstance(ev, (list, tuple)) or len(ev) < 2:
            raise ValueError(f"trace[{i}] must be a (key, nbytes, ...) tuple, got {ev!r}")
        n = ev[1]
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise ValueError(f"trace[{i}] nbytes must be an int (> 0 allocates, < 0 frees), got {n!r}")
    return trace


def replay(trace, conf="", device=None, fraction=None, history=False, stop_on_oom=True):
    """Replay an allocation trace through the model; returns a `Replay`.

    trace: [(key, nbytes, ...)]: nbytes > 0 allocates for `key` (a live key is resized: a new block, then
    the old one freed, as a storage resize does on CUDA), nbytes < 0 frees it; or a `track()` report.
    An out-of-memory error stops the replay (`oom_at` says where) unless stop_on_oom=False.
    """
    a = Allocator(conf, device=device, fraction=fraction, history=history)
    live = {}
    events = _events(trace)
    n = len(events)
    alloc_t = np.zeros(n, dtype=np.int64)
    res_t = np.zeros(n, dtype=np.int64)
    oom_at, peak, largest = None, -1, 0
    malloc, free = a.malloc, a.free
    for i, ev in enumerate(events):
        key, nbytes = ev[0], ev[1]
        if nbytes > 0:
            try:
                b = malloc(nbytes)
            except torch.OutOfMemoryError:
                if oom_at is None:
                    oom_at = i
                alloc_t[i:], res_t[i:] = a.allocated, a.reserved
                if stop_on_oom:
                    alloc_t, res_t = alloc_t[:i + 1], res_t[:i + 1]
                    break
                continue
            old = live.get(key)
            live[key] = b
            if old is not None:
                free(old)
        elif nbytes < 0:
            b = live.pop(key, None)
            if b is not None:
                free(b)
        alloc_t[i], res_t[i] = a.allocated, a.reserved
        if a.reserved > peak:
            peak, largest = a.reserved, a.largest_free()
    return Replay(a.cfg.text, alloc_t, res_t, a.peak_allocated, a.peak_reserved, a.device_mallocs,
                  a.device_frees, a.retries, a.searches, oom_at, largest, a)


def smallest_device(trace, conf="", fraction=None, step=2 * MiB):
    """The smallest device (bytes, a multiple of `step`) on which the trace runs, by bisection.

    Below the peak of allocated blocks nothing runs; with unlimited memory it runs at its peak reserved.
    Bisection assumes a larger device never fails where a smaller one runs (true of these rules in
    practice; the answer is re-checked to run).
    """
    events = _events(trace)
    free_run = replay(events, conf)
    lo = free_run.peak_allocated // step            # fails (or is the floor)
    hi = -(-free_run.peak_reserved // step)         # runs
    if replay(events, conf, device=lo * step, fraction=fraction).ok:
        return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if replay(events, conf, device=mid * step, fraction=fraction).ok:
            hi = mid
        else:
            lo = mid
    return hi * step


# ---- synthetic traces where each knob matters -------------------------------------------------------
def growing_batch(layers=24, batches=(8, 10, 12, 14, 16), per_sample=15 * MiB // 16):
    """Each step allocates one activation per layer (batch x per_sample bytes), then frees them all; the
    batch grows step by step (the case in the allocator's own note on expandable segments)."""
    trace, key = [], 0
    for b in batches:
        keys = range(key, key + layers)
        key += layers
        trace += [(k, b * per_sample, "activations") for k in keys]
        trace += [(k, -b * per_sample, "activations") for k in reversed(keys)]
    return trace


def pinned_holes(rounds=40, temp_start=20 * MiB, temp_step=MiB, small=2 * MiB):
    """Large temporaries of growing size, each followed by a small long-lived tensor (1-10 MiB: large pool)
    that stays: the small ones pin whatever page they land on."""
    trace = []
    for i in range(rounds):
        t = temp_start + i * temp_step
        trace += [(("t", i), t, "activations"), (("s", i), small, "other"), (("t", i), -t, "activations")]
    return trace


def phases(device=500 * MiB, first=12 * MiB, second=30 * MiB, reps=3):
    """Phases of differently sized tensors: three rounds filling most of the device with `first`-sized
    tensors, then three with `second`-sized ones. The first phase's cached segments do not fit the second."""
    trace, key = [], 0
    for size in (first, second):
        n = int(device * 0.85) // size
        for _ in range(reps):
            keys = range(key, key + n)
            key += n
            trace += [(k, size, "activations") for k in keys] + [(k, -size, "activations") for k in keys]
    return trace
