"""labkit.profiling: a training step under torch.profiler, read back: the categorised memory timeline
against lk.track's, operators counted, ranges, and the Python line behind a planted slowdown."""
import json

import pytest
import torch

import labkit as lk
from labkit import profiling


@pytest.fixture(scope="module")
def step():
    model = lk.models.build("llama-2-7b", "tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = next(lk.data.batches(2, 32))
    norms = []

    def log_grad_norms():                     # the planted slowdown: one .item() per parameter
        for p in model.parameters():
            norms.append(p.grad.norm().item())

    def run(slow=False):
        with torch.profiler.record_function("forward"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with torch.profiler.record_function("backward"):
            loss.backward()
        if slow:
            log_grad_norms()
        with torch.profiler.record_function("optimizer step"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    run()                                     # AdamW's state exists from here on
    return model, opt, run


@pytest.fixture(scope="module")
def profiled(step, tmp_path_factory):
    model, opt, run = step
    with lk.track(model, opt) as mem:
        run()
    trace = tmp_path_factory.mktemp("trace") / "sub" / "step.json"
    return mem, profiling.run(run, trace=trace)


def test_timeline_at_the_peak_agrees_with_track(profiled):
    mem, prof = profiled
    assert abs(prof.peak - mem.peak) <= 0.01 * mem.peak
    parts = prof.peak_parts()
    assert set(parts) == set(lk.CATEGORIES)
    for c in lk.CATEGORIES:
        assert abs(parts[c] - mem.peak_parts[c]) <= 0.01 * mem.peak, c
    assert parts["optimizer"] == mem.peak_parts["optimizer"] > 0
    raw = prof.peak_parts(raw=True)
    assert sum(raw.values()) == prof.peak and "OPTIMIZER_STATE" in raw


def test_the_tensors_live_at_the_peak_add_up_to_the_timeline_and_name_autograd_detail(step, profiled):
    """live_at_peak replays the memory events itself: its sizes sum, category by category, to the
    coalesced timeline's at the peak; an AUTOGRAD_DETAIL tensor (what backward makes that is not a
    parameter's gradient) is never larger than the logits, the largest thing backward makes."""
    model, _, _ = step
    _, prof = profiled
    live = prof.live_at_peak()
    by = {}
    for category, size in live:
        by[str(category)] = by.get(str(category), 0) + size
    assert by == {c: b for c, b in prof.peak_parts(raw=True).items() if b}
    assert sum(size for _, size in live) == prof.peak
    logits = 2 * 32 * model.config.vocab_size * 4
    detail = [size for category, size in live if category == "AUTOGRAD_DETAIL"]
    assert max(detail, default=0) <= logits


def test_trace_top_and_counts(step, profiled):
    model, _, _ = step
    _, prof = profiled
    events = json.loads(prof.trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert prof.calls("aten::mm") == 3 * linears           # forward, grad of input, grad of weight
    for by, key in (("time", "self_time_s"), ("memory", "self_bytes"), ("count", "calls")):
        rows = prof.top(by, 5)
        assert len(rows) == 5 and [r[key] for r in rows] == sorted((r[key] for r in rows), reverse=True)
        assert not any(".py(" in r["name"] for r in rows)     # operators, not Python frames, on every torch


def test_ranges(step, profiled):
    model, _, _ = step
    _, prof = profiled
    r = prof.ranges(["forward", "backward", "optimizer step"])
    assert all(row["calls"] == 1 and row["time_s"] > 0 for row in r.values())
    assert r["forward"]["net_bytes"] > 0                         # activations kept for backward
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert r["optimizer step"]["net_bytes"] == -params           # zero_grad(set_to_none) frees the grads
    assert max(row["peak_bytes"] for row in r.values()) == prof.peak
    with pytest.raises(ValueError, match="no range named 'nowhere'"):
        prof.ranges(["nowhere"])
    with pytest.raises(TypeError, match="names must be a list"):
        prof.ranges("forward")


def test_sources_name_the_planted_slowdown(step):
    model, _, run = step
    clean = profiling.run(run, memory=False, shapes=False)
    slow = profiling.run(lambda: run(slow=True), memory=False, shapes=False)
    n = len(list(model.parameters()))
    assert slow.calls("aten::item") - clean.calls("aten::item") == n
    by_user = {}
    for (inner, user), calls in slow.sources("aten::item").items():
        key = user.split(": ")[-1] if user else None
        by_user[key] = by_user.get(key, 0) + calls
    assert by_user["log_grad_norms"] == n
    with pytest.raises(ValueError, match="categorised timeline needs"):
        slow.memory_timeline()


def test_bad_input():
    with pytest.raises(TypeError, match="fn must be callable"):
        profiling.run(3)
    with pytest.raises(ValueError, match="steps must be .*, got 0"):
        profiling.run(lambda: None, steps=0)
    prof = profiling.run(lambda: torch.ones(3).sum(), stack=False)
    with pytest.raises(ValueError, match="by must be one of"):
        prof.top("bytes")
    with pytest.raises(ValueError, match="needs the Python frames"):
        prof.sources("aten::sum")


def test_timeline_on_a_gpu_keeps_events_on_cuda_0():
    """Profile.device is "cuda", but the profiler records CUDA allocations on "cuda:0" and torch's
    `_coalesce_timeline` compares devices exactly: given "cuda" it kept nothing (issue 25, item 9).
    Built from the timeline's own inputs, so it runs without a GPU."""
    from torch.profiler._memory_profiler import Action, Category, MemoryProfileTimeline, TensorKey, _Storage

    def key(i, device):
        return TensorKey(torch.device(device), i, _Storage(ptr=4096 * i, allocation_id=i))

    class Categories:
        def get(self, key, version):
            return {1: Category.PARAMETER, 2: Category.ACTIVATION}.get(key.id)

    timeline = MemoryProfileTimeline.__new__(MemoryProfileTimeline)   # its two fields, set directly
    timeline.categories = Categories()
    timeline.timeline = [(1_000, Action.CREATE, (key(1, "cuda:0"), 0), 512),
                         (2_000, Action.CREATE, (key(2, "cuda:0"), 0), 1024),
                         (2_500, Action.CREATE, (key(3, "cpu"), 0), 64),        # another device: not counted
                         (3_000, Action.DESTROY, (key(2, "cuda:0"), 0), 1024)]
    assert timeline._coalesce_timeline("cuda") == ([], [])             # what the old code got
    times, sizes = profiling._coalesce(timeline, "cuda")
    assert times == [1, 2, 3]                                          # microseconds
    totals = [sum(row) for row in sizes]
    assert totals == [512, 512 + 1024, 512]
    assert profiling._timeline_device({torch.device("cuda:0"), torch.device("cpu")}, "cuda") == torch.device("cuda:0")
    assert profiling._timeline_device({torch.device("cuda:0"), torch.device("cuda:1")}, "cuda:1") == torch.device("cuda:1")
    assert profiling._timeline_device({torch.device("cpu")}, "cpu") == torch.device("cpu")


def test_kineto_asking_for_gpus_without_one_is_not_shown():
    """A CUDA build of torch without a GPU: the first trace of a process makes kineto log "gpuGetDeviceCount
    failed with code 35" to descriptor 2, even for CPU activities. Written there by hand (a CPU build of torch
    never logs it); any other line on descriptor 2 still reaches stderr."""
    import io
    import os
    import sys
    from labkit.memory.profiler import without_profiler_notes
    if torch.cuda.is_available():
        pytest.skip("with a GPU the note is not kineto's way of saying there is none")
    caught = io.StringIO()
    real, sys.stderr = sys.stderr, caught
    try:
        with without_profiler_notes():
            os.write(2, b"ERROR:2026-12-02 06:35:56 12818:12818 DeviceProperties.cpp:50] "
                        b"gpuGetDeviceCount failed with code 35\n")
            os.write(2, b"something else\n")
    finally:
        sys.stderr = real
    assert caught.getvalue() == "something else\n"


def test_torch_2_11s_note_at_the_first_start_is_not_shown(monkeypatch):
    """torch 2.11 warns "Profiler clears events at the end of each cycle" at the first start of any profile (2.13
    only when one profile object starts twice): a UserWarning on a notebook's stderr, for nothing. Stood in for
    here by a profile that warns as 2.11's does; profiling.run and lk.track's profiler backend drop it, and
    any other warning still shows."""
    import warnings
    from torch.profiler import profile
    prepare = profile.prepare_trace

    def warns_as_2_11(self):
        warnings.warn("Warning: Profiler clears events at the end of each cycle.Only events from the current "
                      "cycle will be reported.To keep events across cycles, set acc_events=True.", UserWarning)
        return prepare(self)

    monkeypatch.setattr(profile, "prepare_trace", warns_as_2_11)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        profiling.run(lambda: torch.ones(64).sum(), memory=False, shapes=False, stack=False)
        with lk.track(backend="profiler"):
            torch.ones(64).sum()
        warnings.warn("a warning of the step's own", UserWarning)
    assert [str(w.message) for w in seen] == ["a warning of the step's own"]
