"""Time and peak memory of a function: warm-up, synchronise, median of repeats, one tracked run."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .checks import count
from .memory import track
from .units import fmt_bytes

__all__ = ["measure", "compare", "Result", "Table"]


@dataclass
class Result:
    """One measurement: median seconds, all repeats, the peak bytes and its breakdown."""
    time_s: float
    times: list
    peak: int
    peak_parts: dict
    cuda_peak: int | None = None

    def __repr__(self):
        return f"<measured {self.time_s * 1e3:.2f} ms, peak {fmt_bytes(self.peak)}>"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(fn, *objs, warmup=1, repeat=5):
    """Run `fn()` `warmup` times, then `repeat` timed times (median), then once under `track(*objs)`.

    Timing and memory come from separate runs so that counting does not slow what is timed.
    objs: what already lives and belongs to the peak (model, optimizer), as for `lk.track`.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    warmup, repeat = count("warmup", warmup, 0), count("repeat", repeat, 1)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    with track(*objs) as mem:
        fn()
    cuda_peak = mem.cuda["peak_allocated"] - mem.cuda["allocated_start"] + mem.start if mem.cuda else None
    return Result(statistics.median(times), times, mem.peak, mem.peak_parts, cuda_peak)


class Table:
    """Rows of results with ratios to the first row; prints as text, displays as HTML."""

    def __init__(self, results):
        self.results = results
        base = next(iter(results.values()))
        self.rows = [dict(name=k, time_s=r.time_s, peak=r.peak, time_ratio=r.time_s / base.time_s,
                          peak_ratio=r.peak / base.peak if base.peak else float("nan"))
                     for k, r in results.items()]

    def __getitem__(self, name):
        return self.results[name]

    def _cells(self):
        head = ["variant", "time (ms)", "x time", "peak", "x peak"]
        body = [[r["name"], f"{r['time_s'] * 1e3:.2f}", f"{r['time_ratio']:.2f}", fmt_bytes(r["peak"]),
                 f"{r['peak_ratio']:.2f}"] for r in self.rows]
        return head, body

    def __str__(self):
        head, body = self._cells()
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        fmt = lambda row: "  ".join(str(x).rjust(w) for x, w in zip(row, widths))
        return "\n".join([fmt(head)] + [fmt(r) for r in body])

    __repr__ = __str__

    def _repr_html_(self):
        head, body = self._cells()
        th = "".join(f"<th>{h}</th>" for h in head)
        tr = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in body)
        return f"<table><thead><tr>{th}</tr></thead><tbody>{tr}</tbody></table>"


def compare(variants, *objs, warmup=1, repeat=5):
    """`measure` each of {name: fn}; a Table with ratios to the first variant."""
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"variants must be a non-empty dict of name -> function, got {variants!r}")
    return Table({name: measure(fn, *objs, warmup=warmup, repeat=repeat) for name, fn in variants.items()})
