"""The cost of counting: `lk.track` against the untracked loop and against PyTorch's `MemTracker`.

Two workloads, each timed untracked, under a do-nothing dispatch mode (the floor of any op-by-op
Python tracker), under `lk.track` (reading its report too: peak_parts, max_parts, at()), under
`lk.track(backend="profiler")`, and under `torch.distributed._tools.mem_tracker.MemTracker`:
- a tiny training loop: the tiny Llama preset, AdamW, batch 2, seq 64, 20 steps in one block;
- small steps: a 3-layer MLP 64 wide on a batch of 8, 200 steps, where the per-op cost dominates.
The variants run interleaved, `--repeat` rounds of each in one process (a busy moment of a shared machine
hits every variant); each ratio is the median over the rounds of that round's ratio, each time the median
time; the garbage of the variant before is collected outside the timing. Times are shown, never asserted
(they depend on the CPU). `track/bare` is what the issue holds to: the cost of lk.track's books and hooks
on top of any Python dispatch mode's. On a shared virtual machine the ratios still move by 10% from one
run to the next (bare against bare does too); instruction counts do not: run one variant at a time under
`valgrind --tool=callgrind` and compare their totals.

    python benchmarks/track_overhead.py [--repeat 7]
"""
from __future__ import annotations

import argparse
import gc
import inspect
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import labkit as lk  # noqa: E402


def training_loop(steps=20):
    model = lk.models.build("llama-2-7b", "tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def run(after_step=None):
        for _ in range(steps):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step()
    run()                                   # warm-up: the optimizer state exists from here on
    return model, opt, run


def small_steps(steps=200):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)

    def run(after_step=None):
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if after_step is not None:
                after_step()
    run()
    return model, opt, run


def timed(fn):
    """CPU seconds of this process: steadier than wall time on a shared machine (one thread). The garbage the
    variant before left (a tracker's books are a reference cycle) is collected first, outside the timing."""
    gc.collect()
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def with_track(model, opt, run, backend="dispatch"):
    def go():
        with lk.track(model, opt, **({} if backend == "dispatch" else {"backend": backend})) as mem:
            run()
        mem.peak_parts, mem.max_parts, mem.at("end"), mem.at("start")   # reading the report counts too
    return go


class _Bare(TorchDispatchMode):
    """A dispatch mode that does nothing: the floor any op-by-op Python tracker stands on."""

    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def with_bare_mode(model, opt, run):
    def go():
        with _Bare():
            run()
    return go


def with_memtracker(model, opt, run):
    from torch.distributed._tools.mem_tracker import MemTracker

    def go():
        ref = MemTracker()
        ref.track_external(model, opt)
        with ref:
            run(ref.reset_mod_stats)        # MemTracker refuses a second forward without this
        ref.get_tracker_snapshot("peak")
    return go


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds of every variant; medians are shown")
    args = parser.parse_args()
    torch.set_num_threads(1)
    has_profiler = "backend" in inspect.signature(lk.track).parameters      # labkit before issue 18: no
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, CPU time, medians of {args.repeat} rounds")
    print(f"{'workload':<24}{'untracked':>10}{'bare mode':>10}{'lk.track':>10}{'profiler':>10}{'MemTracker':>11}"
          f"{'track/untracked':>16}{'bare/untracked':>15}{'track/bare':>11}{'profiler/untr.':>15}"
          f"{'track/MemTracker':>17}")
    for name, make in (("tiny training, 20 steps", training_loop), ("small steps, 200", small_steps)):
        model, opt, run = make()
        variants = {"plain": run, "bare": with_bare_mode(model, opt, run), "track": with_track(model, opt, run),
                    "profiler": with_track(model, opt, run, backend="profiler") if has_profiler else None,
                    "memtracker": with_memtracker(model, opt, run)}
        times = {k: [] for k in variants}
        for _ in range(args.repeat):          # interleaved, so that a busy moment hits every variant
            for k, fn in variants.items():
                times[k].append(timed(fn) if fn is not None else float("nan"))
        median = {k: statistics.median(v) for k, v in times.items()}
        ms = {k: f"{v * 1e3:.0f} ms" if v == v else "-" for k, v in median.items()}

        def ratio(a, b):                      # the median of the rounds' ratios: a slow round slows both
            return statistics.median(x / y for x, y in zip(times[a], times[b]))
        profiler = f"{ratio('profiler', 'plain'):.2f}x" if has_profiler else "-"
        print(f"{name:<24}{ms['plain']:>10}{ms['bare']:>10}{ms['track']:>10}{ms['profiler']:>10}{ms['memtracker']:>11}"
              f"{ratio('track', 'plain'):>15.2f}x{ratio('bare', 'plain'):>14.2f}x{ratio('track', 'bare'):>10.2f}x"
              f"{profiler:>15}{ratio('track', 'memtracker'):>16.2f}x")


if __name__ == "__main__":
    main()
