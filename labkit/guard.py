"""Survive an out-of-memory error, pretend the device is smaller, and say what a section needs."""
from __future__ import annotations

import contextlib
import gc
import sys
import traceback

import torch

from .device import has
from .memory import track
from .units import fmt_bytes, parse_bytes

__all__ = ["oom_guard", "budget", "free", "requires"]


class oom_guard(contextlib.AbstractContextManager):
    """Catch `torch.OutOfMemoryError` in the block, free what its frames held, report, go on.

    After the block: `.oom` is True if it ran out of memory, `.message` says what happened.
    """

    def __init__(self, quiet=False):
        self.quiet, self.oom, self.message = quiet, False, None

    def __exit__(self, kind, exc, tb):
        if kind is None or not issubclass(kind, torch.OutOfMemoryError):
            return False
        self.oom, self.message = True, str(exc).splitlines()[0]
        traceback.clear_frames(tb)            # the frames' locals are what keep the tensors alive
        exc.__traceback__ = None
        sys.last_value = sys.last_traceback = None
        del exc, tb
        free()
        if not self.quiet:
            where = (f"; CUDA allocated now {fmt_bytes(torch.cuda.memory_allocated())}"
                     if torch.cuda.is_available() else "")
            print(f"OutOfMemoryError caught: {self.message}{where}. The kernel goes on.")
        return True


@contextlib.contextmanager
def budget(size, *objs):
    """Pretend the device holds only `size` bytes ("2 GiB", or an int).

    CUDA: a per-process memory fraction, so the caching allocator raises a real OOM.
    CPU (and fake/meta): a `track()` over `objs` (modules, optimizers, tensors counted from the start)
    that raises `torch.OutOfMemoryError` once live bytes pass the budget. Yields the tracker.
    """
    limit = parse_bytes(size, "size")
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
        try:
            with track(*objs) as mem:
                yield mem
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
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
