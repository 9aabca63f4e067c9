"""Run inside each notebook's kernel by `make test-gpu` (labkit/scripts/gpu_run.py), before the first cell.

Fences the kernel's CUDA caching allocator to $LABKIT_GPU_FENCE bytes (gpu_run sets it to labkit.device's
CARD * (1 - HEADROOM) = 21.6 GiB, what tests/test_full_size.py promises each step fits; a per-process memory
fraction: the allocator frees its cache and retries before it raises, as on a card of that size), and keeps the
kernel's peak reserved and allocated bytes in $LABKIT_GPU_PEAK_FILE (JSON, rewritten after every cell:
nbval kills the kernel at the end, so nothing waits for an exit). A notebook's own
torch.cuda.reset_peak_memory_stats() (lk.free calls it) first folds the peak so far into the record. A
cell that leaves the fraction above the fence (a budget that set 1.0 on exit) is counted and fenced again.

It is executed with exec() in a namespace of its own (IPKernelApp.exec_lines): no name reaches the notebook.
Standard library, torch and IPython only: labkit is not imported before the notebook imports it.
"""
import json
import os

import torch
from IPython import get_ipython

FENCE = int(os.environ["LABKIT_GPU_FENCE"])
PEAK_FILE = os.environ["LABKIT_GPU_PEAK_FILE"]
TOTAL = torch.cuda.get_device_properties(0).total_memory
FRACTION = min(1.0, FENCE / TOTAL)
torch.cuda.set_per_process_memory_fraction(FRACTION)
peak = {"peak_reserved_bytes": 0, "peak_allocated_bytes": 0, "fence_bytes": FENCE, "gpu_memory_bytes": TOTAL,
        "cells": 0, "fence_lifted": 0}
_reset = torch.cuda.memory.reset_peak_memory_stats


def _fold():
    peak["peak_reserved_bytes"] = max(peak["peak_reserved_bytes"], torch.cuda.max_memory_reserved())
    peak["peak_allocated_bytes"] = max(peak["peak_allocated_bytes"], torch.cuda.max_memory_allocated())


def reset_peak_memory_stats(device=None):
    """torch.cuda.reset_peak_memory_stats, after keeping the peak so far."""
    _fold()
    _reset(device)


def _write():
    tmp = f"{PEAK_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(peak, f)
    os.replace(tmp, PEAK_FILE)                 # never half a file


def _after_cell(result=None):
    _fold()
    peak["cells"] += 1
    if torch.cuda.get_per_process_memory_fraction() > FRACTION + 1e-9:
        peak["fence_lifted"] += 1
        torch.cuda.set_per_process_memory_fraction(FRACTION)
    _write()


torch.cuda.reset_peak_memory_stats = torch.cuda.memory.reset_peak_memory_stats = reset_peak_memory_stats
get_ipython().events.register("post_run_cell", _after_cell)
_write()
