"""Count what the process group is asked to send: `process_group_calls()`, whoever calls it.

`labkit.tensor_parallel.COMM` and `labkit.zero.COMM` are the engines' own tallies; this counter sits below them, in the
methods of torch's `ProcessGroup`, so a count from here checks the engines' bookkeeping instead of repeating it.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = ["process_group_calls"]


# Collectives as the process group receives them: each method, the argument holding the bytes sent
# (an all-reduce's tensors, a reduce-scatter's input, an all-gather's output), and what to call it.
# torch 2.13 names them all_gather_single / reduce_scatter_single, earlier releases _allgather_base / ...
_PG_METHODS = {"allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
               "reduce_scatter_single": ("reduce_scatter", 1), "_reduce_scatter_base": ("reduce_scatter", 1),
               "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1), "reduce_scatter": ("reduce_scatter", 1),
               "all_gather_single": ("all_gather", 0), "_allgather_base": ("all_gather", 0),
               "allgather_into_tensor_coalesced": ("all_gather", 0), "allgather": ("all_gather", 0)}


# Keyword names the process group's methods take for the argument that holds the bytes.
_PG_KEYWORDS = {0: ("tensors", "tensor", "output", "output_tensor", "output_tensors", "outputs"),
                1: ("input", "input_tensor", "input_tensors", "inputs")}
_PG_ACTIVE = []                       # the count dicts of the process_group_calls blocks now open
_PG_SAVED = {}                        # the class's own methods while any block is open


def _pg_bytes(t):
    while isinstance(t, (list, tuple)) and t and isinstance(t[0], (list, tuple)):   # [[t, ...]]
        t = [x for inner in t for x in inner]
    return sum(x.nbytes for x in t) if isinstance(t, (list, tuple)) else t.nbytes


def _pg_counted(name):
    kind, arg = _PG_METHODS[name]

    def call(self, *args, **kwargs):
        t = args[arg] if len(args) > arg else next((kwargs[k] for k in _PG_KEYWORDS[arg] if k in kwargs), None)
        n = 0 if t is None else _pg_bytes(t)
        for counts in _PG_ACTIVE:
            counts[kind] += n
            counts["calls"] += 1
        return _PG_SAVED[name].__get__(self, type(self))(*args, **kwargs)
    return call


@contextlib.contextmanager
def process_group_calls():
    """Bytes of every collective this rank's process group is asked to run, counted in the ProcessGroup's own
    methods (whatever code calls them, so a count independent of the caller's bookkeeping):
    {"all_reduce": bytes, "reduce_scatter": bytes (input), "all_gather": bytes (output), "calls": n}.
    Blocks may nest or close in any order; each counts what ran while it was open. Not counted:
    functional collectives (torch.distributed._functional_collectives, which DTensor uses)."""
    counts = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "calls": 0}
    if not _PG_ACTIVE:
        # The class's own entries (pybind's instancemethod descriptors): restoring them keeps `self` bound.
        _PG_SAVED.update({n: vars(dist.ProcessGroup)[n] for n in _PG_METHODS if n in vars(dist.ProcessGroup)})
        for name in _PG_SAVED:
            setattr(dist.ProcessGroup, name, _pg_counted(name))
    _PG_ACTIVE.append(counts)
    try:
        yield counts
    finally:
        del _PG_ACTIVE[next(i for i, c in enumerate(_PG_ACTIVE) if c is counts)]   # by identity: dicts compare equal
        if not _PG_ACTIVE:
            for name, method in _PG_SAVED.items():
                setattr(dist.ProcessGroup, name, method)
            _PG_SAVED.clear()
