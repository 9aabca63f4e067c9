"""`ProfilerTracker`: `track(..., backend="profiler")`, counting from `torch.profiler`'s memory events.

Compiled code runs no dispatch mode, but the allocator still reports every allocation and free to
the profiler (`profile_memory=True`). This backend sums those `[memory]` events in time order; in
eager their running sum equals the dispatch tracker's count byte for byte (tests/test_memory.py).
The categories come from the same hooks as the dispatch backend's, but a hook cannot label an event
the profiler has not delivered yet: each hook's command (mark, push or pop a phase, label an
address) is stored and placed on the profiler's timeline by an instant `record_function` marker,
then replayed against the events when the block ends. So `live`, `peak` and the timeline are known
once the block ends; fake and meta tensors allocate nothing and cannot be counted here; no budget.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import os
import re
import sys
import tempfile
import warnings

import torch

from .report import CATEGORY_INDEX, OTHER, Tracker

__all__ = ["ProfilerTracker", "without_profiler_notes"]


class ProfilerTracker(Tracker):
    """`track(..., backend="profiler")`: sums the profiler's memory events (see the module docstring)."""
    backend = "profiler"
    takes_budget = False
    nests = False           # one torch profiler at a time, and it would count another tracker's work

    def __init__(self, *objs, budget=None, device=None, snapshot=None):
        super().__init__(*objs, budget=budget, device=device, snapshot=snapshot)
        self._prof = None      # the running torch.profiler.profile, inside the block
        self._notes = None
        self._cmds = []        # what the hooks did, replayed against the profiler's events
        self._where = {}       # (device type, address) -> serial of what lives there

    # ---- what the hooks see ---------------------------------------------------------------
    def _see_storage(self, st, t, category):
        try:
            addr = None if st.device.type == "meta" else (st.device.type, st.data_ptr())
        except (RuntimeError, NotImplementedError):
            addr = None
        if addr is None:
            raise ValueError("backend='profiler' counts real allocations; fake or meta tensors need "
                             f"backend='dispatch', got a tensor on {st.device}")
        if self._prof is not None:               # inside the block: replayed against the events later
            self._command("label", addr, CATEGORY_INDEX[category or "other"])
        elif addr not in self._where and not self._closed:   # what the objects passed in hold
            self._where[addr] = len(self._label)
            self._label.append(CATEGORY_INDEX[category or "other"])
            self._change(self._where[addr], st.nbytes())
        elif addr in self._where and category is not None:
            self._label[self._where[addr]] = CATEGORY_INDEX[category]
            self._version += 1

    def mark(self, text):
        """Put a named mark on the timeline at this moment."""
        if self._prof is not None:
            self._command("mark", str(text))
        else:
            super().mark(text)

    def _push(self, category):
        super()._push(category)
        if self._prof is not None:
            self._command("push", category)

    def _pop(self):
        super()._pop()
        if self._prof is not None:
            self._command("pop")

    def _command(self, *command):
        """Store a hook's command and put an instant op in the profiler's trace at this moment."""
        self._cmds.append(command)
        with torch.profiler.record_function(f"labkit::{len(self._cmds) - 1}"):
            pass

    # ---- the block ------------------------------------------------------------------------
    def _start_counting(self):
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, profile_memory=True)
        self._notes = without_profiler_notes()          # until the block ends: see its docstring
        self._notes.__enter__()
        logging.getLogger("torch._dynamo.variables.ctx_manager").addFilter(drop_record_function_note)
        with warnings.catch_warnings():      # torch 2.11 warns "Profiler clears events" at any first start
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
            self._prof.__enter__()

    def _stop_counting(self):
        if self._prof is not None:
            prof, self._prof = self._prof, None
            try:
                prof.__exit__(None, None, None)
            finally:
                self._notes.__exit__(None, None, None)
            self._replay(prof)

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
        timed.sort(key=operator.itemgetter(0, 1))       # by time; at the same time, an event before a command
        where, self._phase = self._where, [OTHER]
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


def drop_record_function_note(record):
    """Dynamo's one-time note that it ignores a `record_function` inside compiled code. The profiler
    backend's marks sit outside compiled code, so the note says nothing a learner needs: drop it alone."""
    return "Profiler record function" not in record.getMessage()


# A CUDA build of torch (kineto built with CUPTI) asks for the GPUs' properties once per process when it
# writes its first trace (DeviceProperties.cpp), even for CPU activities only; without a GPU or driver it
# logs "gpuGetDeviceCount failed with code 35" (cudaErrorInsufficientDriver) or 100 (no device).
KINETO_NO_GPU = re.compile(r"^ERROR:.*\] gpuGetDeviceCount failed with code \d+")


@contextlib.contextmanager
def without_profiler_notes():
    """Drop the profiler's own notes to file descriptor 2: kineto's "STAGE:"/"USDT:" lines at every start
    and stop, and c10's one-time "Memory block of unknown size was allocated before the profiling
    started" when a block born before is freed, and on a CUDA build of torch without a GPU kineto's
    one-time "gpuGetDeviceCount failed" (KINETO_NO_GPU). Anything else written to descriptor 2 meanwhile
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
                        or "Memory block of unknown size was allocated before the profiling started" in line
                        or KINETO_NO_GPU.search(line) and not torch.cuda.is_available()):
                    sys.stderr.write(line)
