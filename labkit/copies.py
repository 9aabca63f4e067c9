"""Counting what offloading moves, from outside the movers (notebook 04 asserts these counts).

- `CrossDeviceCopies`: the bytes copies move between two different devices (the seed's `Swapper`,
  accelerate's `cpu_offload` on a GPU).
- `SavedBytesByDevice`: saved-tensor hooks that count the bytes autograd saves for backward, by device.
- `CountedHooks`: wraps any pack/unpack pair and counts, from the outside, what it copies and gives back.
- `GradWeightCopies`: the bytes copy ops read out of a model's gradients and write into its weights.
- `numpy_bytes()`: the bytes of every numpy buffer alive now (host memory, as `tracemalloc` sees it).
- `count_weight_reads(model)`: the bytes accelerate's offload hooks load per forward.
"""
from __future__ import annotations

import contextlib
import tracemalloc
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .memory.walk import tensors

__all__ = ["CrossDeviceCopies", "SavedBytesByDevice", "CountedHooks", "GradWeightCopies", "numpy_bytes",
           "count_weight_reads", "storages"]


def storages(objs, name):
    """The data pointers of the storages behind every tensor in `objs`: a module, a tensor, None, or a list,
    tuple, set or iterator (e.g. `model.parameters()`) of them, walked by labkit.memory.walk.tensors; a
    TypeError naming `name` (and the item) for anything else."""
    items = list(objs) if isinstance(objs, (list, tuple, set, frozenset, Iterator)) else [objs]
    for i, item in enumerate(items):
        if not isinstance(item, (torch.Tensor, torch.nn.Module, list, tuple, type(None))):
            where = name if items == [objs] else f"{name}[{i}]"
            raise TypeError(f"{where} must be a module or a tensor (or a list of them), got "
                            f"{type(item).__name__} {item!r:.80}")
    return {t.untyped_storage().data_ptr() for t in tensors(items)}


class CrossDeviceCopies(TorchDispatchMode):
    """Counts the bytes that copies move between two different devices (e.g. cuda -> cpu), by route.

        with CrossDeviceCopies() as moved:
            y = model(x)
        moved.bytes, moved.routes          # total; {"cuda->cpu": bytes, ...}

    A `.to()` or `.cpu()` to the device a tensor already lives on is no copy and counts nothing.
    """

    def __init__(self):
        super().__init__()
        self.routes, self.copies = {}, 0

    @property
    def bytes(self):
        return sum(self.routes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = dst = None
        if func in (torch.ops.aten._to_copy.default,) and isinstance(out, torch.Tensor):
            src, dst = args[0], out
        elif func in (torch.ops.aten.copy_.default,):
            src, dst = args[1], args[0]
        if src is not None and src.device != dst.device:
            route = f"{src.device.type}->{dst.device.type}"
            self.routes[route] = self.routes.get(route, 0) + dst.numel() * dst.element_size()
            self.copies += 1
        return out


class SavedBytesByDevice(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for backward while the block runs, by device type: `.bytes`.

        with SavedBytesByDevice() as saved:
            loss = model(x).sum()
        saved.bytes                      # {"cpu": ..., "cuda": ...}; a storage saved twice counts once
    """

    def __init__(self):
        self.bytes, self._seen = {}, set()
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        super().__enter__()
        return self

    def pack(self, t):
        """Counts `t`'s storage once per device; autograd keeps `t` itself."""
        st = t.untyped_storage()
        key = (t.device.type, st._cdata)        # the storage itself (its data pointer is no key on fake tensors)
        if key not in self._seen:
            self._seen.add(key)
            self.bytes[t.device.type] = self.bytes.get(t.device.type, 0) + st.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t


class CountedHooks(torch.autograd.graph.saved_tensors_hooks):
    """Wraps a pack/unpack pair (any `saved_tensors_hooks`) and counts, from outside it, what it does.

    `tally`: "saved" (tensors autograd handed to pack), "copied" (pack returned something other than the
    tensor's own storage), "copied_bytes", "weights" (copies of a tensor sharing a storage with one of
    `weights`), "unpacked" (unpack calls for a copied save), "unpacked_bytes" (bytes of what they returned).
    Entering it also enters `hooks` when that is a context manager with its own exit work (e.g.
    `ActivationOffload`), so its clean-up runs.
    """

    def __init__(self, hooks, weights=()):
        self.hooks = hooks
        self._weights = storages(list(weights), "weights")
        self.tally = dict(saved=0, copied=0, copied_bytes=0, weights=0, unpacked=0, unpacked_bytes=0)
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        super().__enter__()
        return self

    def pack(self, t):
        """The wrapped pack's result, tagged "same" (it kept `t`'s storage) or "copied" (counted)."""
        out = self.hooks.pack_hook(t)
        self.tally["saved"] += 1
        if out is t:
            return ("same", out)
        stored = out[1] if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) else out
        if isinstance(stored, torch.Tensor) and stored.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            return ("same", out)
        self.tally["copied"] += 1
        self.tally["copied_bytes"] += t.numel() * t.element_size()
        self.tally["weights"] += t.untyped_storage().data_ptr() in self._weights
        return ("copied", out)

    def unpack(self, packed):
        """The wrapped unpack's result; a copied save's unpack and the bytes it returns are counted."""
        how, inner = packed
        out = self.hooks.unpack_hook(inner)
        if how == "copied":
            self.tally["unpacked"] += 1
            self.tally["unpacked_bytes"] += out.numel() * out.element_size()
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        packed = getattr(self.hooks, "_packed", None)   # an offload.ActivationOffload's books of packed tensors
        if packed is not None:
            packed.clear()                      # what ActivationOffload's own exit does
        return result


class GradWeightCopies(TorchDispatchMode):
    """Bytes that copy ops (`aten.copy_`) read out of `model`'s gradients (`from_grads`) and write into
    its weights (`into_weights`) while the block runs: what an optimizer on the host must move."""

    def __init__(self, model):
        super().__init__()
        self.params = list(model.parameters())
        self.weights = {p.untyped_storage().data_ptr() for p in self.params}
        self.from_grads = self.into_weights = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            grads = {p.grad.untyped_storage().data_ptr() for p in self.params if p.grad is not None}
            if src.untyped_storage().data_ptr() in grads:
                self.from_grads += src.numel() * src.element_size()
            if dst.untyped_storage().data_ptr() in self.weights:
                self.into_weights += dst.numel() * dst.element_size()
        return func(*args, **(kwargs or {}))


def numpy_bytes():
    """Bytes of every numpy buffer alive now, as `tracemalloc` sees them (numpy reports its allocations to
    tracemalloc in a domain of its own); 0 unless `tracemalloc.start()` ran before they were allocated."""
    if not tracemalloc.is_tracing():
        return 0
    domain = tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)
    return sum(trace.size for trace in tracemalloc.take_snapshot().filter_traces([domain]).traces)


class _CountingMap(Mapping):
    """A weights map that adds the bytes of every tensor it hands out to `counter["bytes"]`."""

    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter

    def __getitem__(self, key):
        t = self.inner[key]
        self.counter["bytes"] += t.numel() * t.element_size()
        self.counter["reads"] += 1
        return t

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


@contextlib.contextmanager
def count_weight_reads(model):
    """Count the bytes accelerate's offload hooks load into `model`'s modules while the block runs.

    Wraps the weights map of every `AlignDevicesHook` (from `disk_offload`, `cpu_offload`, or
    `from_pretrained(device_map=..., offload_folder=...)`); yields {"bytes": ..., "reads": ...}.
    """
    counter, wrapped = {"bytes": 0, "reads": 0}, []
    for module in model.modules():
        hooks = [getattr(module, "_hf_hook", None)]
        hooks += list(getattr(hooks[0], "hooks", ()))           # SequentialHook
        for hook in hooks:
            wmap = getattr(hook, "weights_map", None)
            if wmap is None:
                continue
            if hasattr(wmap, "dataset"):                          # PrefixedDataset over the loader
                wrapped.append((wmap, "dataset", wmap.dataset))
                wmap.dataset = _CountingMap(wmap.dataset, counter)
            else:
                wrapped.append((hook, "weights_map", wmap))
                hook.weights_map = _CountingMap(wmap, counter)
    if not wrapped:
        raise ValueError("model has no accelerate offload hooks with a weights map: offload it first "
                         "(disk_offload, cpu_offload, or from_pretrained with an offload_folder)")
    try:
        yield counter
    finally:
        for obj, attr, original in reversed(wrapped):
            setattr(obj, attr, original)
