"""Count live tensor memory by category, on any device, also under FakeTensorMode and on meta.

`track()` returns a report whose books are allocation and free events, each storage with its
*final* category (parameters, gradients, optimizer, activations, kv_cache, other), and builds from
them the peak, the breakdown at the peak, a timeline, and `trace` (allocations and frees with sizes
and categories, for `labkit.alloc.replay`). On CUDA the allocator's own peak
(`torch.cuda.max_memory_allocated`) is read as well. Two backends fill the same books, one class each:

- `dispatch.py`, `DispatchTracker` (the default): a `TorchDispatchMode` sees every tensor an op
  creates and counts its storage once; a weak reference's callback subtracts it when it dies. Works
  on fake and meta tensors, can enforce a budget, cannot see compiled code (it refuses the block).
- `profiler.py`, `ProfilerTracker`: sums `torch.profiler`'s `[memory]` events; sees compiled code and
  `resize_`; needs real allocations; no budget; nests with no other tracker.
- `report.py`, `Tracker`: what both share: the books, the hooks that give categories, the report.
- `walk.py`: the tensors an object holds (modules, optimizers, containers, caches).

Neither backend sees tensors made by other threads (`threading.Thread`, DataLoader workers).
Cost (benchmarks/track_overhead.py): any Python dispatch mode, even one that does nothing, makes
each op pay a trip through Python; the counting adds, per allocation, a storage object, a weak
reference (its callback books the free) and three list appends, and per op that returns a tensor a
dict look-up (a view, by its schema, returns at once). The hooks that give categories cost two calls
per module forward and two per backward, none per parameter (`make bench` prints the cost against a
dispatch mode that does nothing). The timeline is built once, when first read, and cached.
"""
from __future__ import annotations

from .dispatch import DispatchTracker
from .profiler import ProfilerTracker
from .report import CATEGORIES, Tracker

__all__ = ["CATEGORIES", "BACKENDS", "track", "Tracker", "DispatchTracker", "ProfilerTracker"]

BACKENDS = ("dispatch", "profiler")
TRACKERS = {"dispatch": DispatchTracker, "profiler": ProfilerTracker}


def track(*objs, budget=None, device=None, snapshot=None, backend="dispatch"):
    """Context manager: peak and timeline of live tensor bytes, by category.

    objs: modules, optimizers, tensors (or lists/dicts of them) that already exist; their memory is
    counted from the start and gives the categories (a module's parameters and grads, an optimizer's
    state). Tensors made inside the block are counted as they are created. Only weak references are
    kept: once the block ends, deleting the model frees it even while the report lives.
    budget: bytes or "2 GiB"; past it an op raises `torch.OutOfMemoryError` (what `lk.budget` uses).
    device: count only tensors on this device type ("cpu", "cuda", "meta"); default: all.
    snapshot: on CUDA, a file to write the allocator's memory snapshot to (open it with
    https://pytorch.org/memory_viz); ignored elsewhere.
    Categories: "kv_cache" is a K/V cache kept for later tokens (no autograd graph); in a training
    forward with `use_cache` on, the cache's K and V are tensors backward needs: "activations".
    backend: "dispatch" (default) counts storages op by op, also on fake and meta tensors; it cannot
    see other threads, `resize_` of storages born before the block, nor compiled code (it raises if
    a `torch.compile`d function runs in the block). "profiler" sums `torch.profiler`'s memory events
    instead, with the same report and categories: it sees compiled code and `resize_`, not other
    threads either (the profiler too records the thread that started it), not fake/meta tensors
    (nothing is allocated); no budget; `live` and `peak` are known once the block ends. Inside
    compiled code the submodules' hooks do not run: pass the compiled module itself
    (`track(compiled_model, opt, backend="profiler")`) to get its "forward" marks.
    Nesting: dispatch trackers nest, each counting on its own (an `lk.budget` inside an `lk.track`); a
    profiler tracker nests with none (RuntimeError).
    """
    if backend not in TRACKERS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return TRACKERS[backend](*objs, budget=budget, device=device, snapshot=snapshot)

