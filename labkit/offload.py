"""Offloading, counted: activations to the host, to disk or to bf16; Adam's state on the host; bandwidth.

Notebook 04 teaches these; the tests check them. Every mover counts the bytes it moves, so a notebook
asserts bytes (exact) and only prints seconds (a shared CPU's clock is noise).

What "device" and "host" mean here. On a GPU: GPU memory and CPU memory. On a CPU-only machine both are
the same RAM, so we define them by who owns the memory: the *device* is what `lk.track` counts (torch
storages); the *host* is memory outside torch (numpy buffers, files). Moving a tensor to the host is
then a real copy out of torch's books, exactly as a GPU-to-CPU copy leaves the GPU's.

- `ActivationOffload(to="host" | "disk" | "bf16")`: `torch.autograd.graph.saved_tensors_hooks` whose
  pack moves each tensor that autograd saves for backward, and whose unpack brings it back.
- `HostAdam`: AdamW whose moments and fp32 master weights live on the host, and whose update is computed
  there (ZeRO-Offload's idea, Ren et al. 2021); the device holds only the weights and gradients.
- `bandwidth(route)`, `bandwidth_runs(route)`: measured bytes per second of one copy route (into one warm
  buffer, or a fresh one per copy as a hook allocates).
- Counting what moves, from outside the movers (`CrossDeviceCopies`, `SavedBytesByDevice`, `CountedHooks`,
  `GradWeightCopies`, `numpy_bytes`, `count_weight_reads`): labkit/copies.py.
- `SeedSwapper`: the seed material's module as written (`x = x.cpu(); x = self.module(x); return x.cuda()`),
  kept to be run and measured; `Swapper`: what it was meant to do (the layer on the device, its input
  and output on the host).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import pathlib
import statistics
import time
import weakref

import numpy as np
import torch

from .checks import count
from .copies import storages
from .units import parse_bytes

__all__ = ["ActivationOffload", "HostAdam", "bandwidth", "bandwidth_runs", "ROUTES", "SeedSwapper", "Swapper",
           "to_host", "from_host"]

TARGETS = ("host", "disk", "bf16")


def to_host(t):
    """A copy of `t`'s values in a numpy byte buffer (memory outside torch): (buffer, dtype, shape)."""
    buf = np.empty(t.numel() * t.element_size(), dtype=np.uint8)
    if buf.size:
        torch.from_numpy(buf).view(t.dtype).view(t.shape).copy_(t)   # from_numpy: no new torch storage
    return buf, t.dtype, tuple(t.shape)


def from_host(buf, dtype, shape, like=None, device="cpu"):
    """A new torch tensor (device memory) holding the bytes in `buf`, with `like`'s strides when dense."""
    if like is not None and _dense(like):
        out = torch.empty_strided(shape, like.stride(), dtype=dtype, device=device)
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    if buf.size:
        out.copy_(torch.from_numpy(buf).view(dtype).view(shape))
    return out


def _dense(t):
    """True when `t`'s elements fill a storage span without gaps or overlap (then its strides can be kept)."""
    if t.numel() == 0:
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, n in dims:
        if stride != expected:
            return False
        expected *= n
    return True


class _Strides:
    """Sizes and strides of a packed tensor, enough to rebuild it as it was."""
    __slots__ = ("shape", "_stride")

    def __init__(self, t):
        self.shape, self._stride = tuple(t.shape), tuple(t.stride())

    def stride(self):
        return self._stride

    def numel(self):
        return int(np.prod(self.shape, dtype=np.int64))


class _OnDisk:
    """One tensor in a file; the file is removed when autograd drops the saved tensor."""

    def __init__(self, path, dtype, like):
        self.path, self.dtype, self.like = path, dtype, like

    def __del__(self):
        with contextlib.suppress(OSError):
            os.remove(self.path)


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Move what autograd saves for backward out of device memory, and back when backward needs it.

        with ActivationOffload("host", keep=model) as off:
            loss = model(ids, labels=ids).loss          # each saved tensor is packed (moved out)
        loss.backward()                                  # ... and unpacked (moved back) when used
        off.bytes_out, off.bytes_in                      # exact byte counts

    to: "host" (a numpy buffer), "disk" (a file in `folder`), "bf16" (an fp32 tensor kept as bf16 on the
    device: half the bytes, lossy: round to nearest keeps 8 significant bits, a relative error of at most
    2**-8 per element, bf16's unit roundoff).
    keep: modules or tensors whose storages stay where they are (the weights: moving a parameter copies
    it every time an op saves it, and the device keeps it anyway). Also kept: integer and bool tensors
    (indices, labels, masks: packing the labels as floats would corrupt the loss; bf16 cannot hold them
    exactly) and tensors under `min_bytes` (not worth a copy). `kept` counts what stayed.
    Each op saves its own reference, so the same tensor reaches pack once per op that saves it. Packing
    it twice would move its bytes twice (and for bf16 store two half-size copies: no saving at all);
    so a tensor already packed while it lives is not packed again (`shared` counts those).
    """

    def __init__(self, to="host", keep=(), min_bytes=1024, folder=None):
        if to not in TARGETS:
            raise ValueError(f"to must be one of {TARGETS}, got {to!r}")
        if to == "disk" and folder is None:
            raise ValueError("folder must name a directory for to='disk', got None")
        self.to, self.min_bytes = to, count("min_bytes", min_bytes, 0)
        self.folder = None if folder is None else pathlib.Path(folder)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self._keep = storages(keep, "keep")
        self._serial = itertools.count()
        self.bytes_out = self.bytes_in = 0       # bytes written to the target / read back from it
        self.offloaded_bytes = 0                 # bytes of the tensors that were packed, as the device held them
        self.packs = self.unpacks = self.shared = 0
        self._packed = {}                        # (storage id, view, version) -> packed, while the storage lives
        self.kept = self.kept_bytes = 0
        self.seconds_out = self.seconds_in = 0.0
        super().__init__(self.pack, self.unpack)

    def __enter__(self):                                  # `with ActivationOffload(...) as off:` gives off
        super().__enter__()
        return self

    def offloads(self, t):
        """Whether `t` is moved (True) or kept as it is (False), by the rules in the class docstring."""
        if not t.is_floating_point() or t.numel() * t.element_size() < self.min_bytes:
            return False
        if self.to == "bf16" and t.dtype != torch.float32:
            return False
        return t.untyped_storage().data_ptr() not in self._keep

    def pack(self, t):
        if not self.offloads(t):
            self.kept += 1
            self.kept_bytes += t.numel() * t.element_size()
            return t
        st = t.untyped_storage()
        key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        hit = self._packed.get(key)
        if hit is not None and hit[0]() is st:
            self.shared += 1
            return hit[1]
        start = time.perf_counter()
        self.packs += 1
        self.offloaded_bytes += t.numel() * t.element_size()
        if self.to == "bf16":
            packed = (t.to(torch.bfloat16),)            # a tuple: kept tensors come back as they are
            self.bytes_out += packed[0].numel() * packed[0].element_size()
        else:
            buf, dtype, _ = to_host(t)
            packed = (buf, dtype, _Strides(t), t.device)
            if self.to == "disk":
                path = self.folder / f"saved_{os.getpid()}_{next(self._serial)}.bin"
                buf.tofile(path)
                packed = (_OnDisk(path, dtype, _Strides(t)), t.device)
                self.bytes_out += os.path.getsize(path)
            else:
                self.bytes_out += buf.nbytes
        self._packed[key] = (weakref.ref(st, lambda _, k=key: self._packed.pop(k, None)), packed)
        self.seconds_out += time.perf_counter() - start
        return packed

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed                            # kept
        start = time.perf_counter()
        self.unpacks += 1
        if self.to == "bf16":
            self.bytes_in += packed[0].numel() * packed[0].element_size()
            out = packed[0].to(torch.float32)
        elif self.to == "disk":
            disk, device = packed
            buf = np.fromfile(disk.path, dtype=np.uint8)
            self.bytes_in += buf.nbytes
            out = from_host(buf, disk.dtype, disk.like.shape, disk.like, device)
        else:
            buf, dtype, like, device = packed
            self.bytes_in += buf.nbytes
            out = from_host(buf, dtype, like.shape, like, device)
        self.seconds_in += time.perf_counter() - start
        return out

    def __exit__(self, *exc):
        self._packed.clear()       # sharing is within one block; after it only autograd holds what was packed
        return super().__exit__(*exc)

    def __repr__(self):
        return (f"<ActivationOffload to={self.to}: {self.packs} packed ({self.offloaded_bytes:,} B), "
                f"{self.bytes_out:,} B out, {self.bytes_in:,} B back, {self.shared} shared, {self.kept} kept>")


class HostAdam(torch.optim.Optimizer):
    """AdamW with its state on the host and the update computed there (ZeRO-Offload, Ren et al. 2021).

    The host keeps, per parameter, an fp32 master copy and Adam's two moments (numpy arrays: 12 bytes per
    parameter that the device no longer holds). A step copies each gradient to the host, updates there,
    and copies the new weights back: `bytes_to_host` and `bytes_to_device` count both directions (each
    `numel x element size` per parameter and step). The arithmetic is torch's AdamW (decoupled weight
    decay, bias correction) in numpy float32; it agrees with `torch.optim.AdamW` to float32 rounding,
    not bit for bit (numpy and torch order and fuse the operations differently).
    DeepSpeed's `DeepSpeedCPUAdam` is the production version (a vectorised C++ kernel, overlapped copies).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise TypeError(f"params must be float32 (the host master copy is fp32), got {p.dtype}")
        self.host = {}                 # param -> {"step", "param", "exp_avg", "exp_avg_sq"} (numpy)
        self.bytes_to_host = self.bytes_to_device = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.host.get(p)
                if s is None:
                    s = self.host[p] = {"step": 0, "param": to_host(p)[0].view(np.float32).copy(),
                                        "exp_avg": np.zeros(p.numel(), np.float32),
                                        "exp_avg_sq": np.zeros(p.numel(), np.float32)}
                g = to_host(p.grad)[0].view(np.float32)                # device -> host
                self.bytes_to_host += g.nbytes
                s["step"] += 1
                w, m, v, t = s["param"], s["exp_avg"], s["exp_avg_sq"], s["step"]
                w *= np.float32(1 - lr * wd)                            # decoupled weight decay
                m *= np.float32(b1)
                m += np.float32(1 - b1) * g
                v *= np.float32(b2)
                v += np.float32(1 - b2) * g * g
                denom = np.sqrt(v) / np.float32((1 - b2 ** t) ** 0.5) + np.float32(eps)
                w -= np.float32(lr / (1 - b1 ** t)) * m / denom
                p.copy_(torch.from_numpy(w).view(p.shape))             # host -> device
                self.bytes_to_device += w.nbytes
        return loss

    def host_bytes(self):
        """Bytes the host holds for the optimizer: master weights and both moments."""
        return sum(a.nbytes for s in self.host.values() for k, a in s.items() if k != "step")


ROUTES = ("device->host", "host->device", "host->disk", "disk->host",
          "device->pinned", "pinned->device", "device->pageable", "pageable->device")


def bandwidth(route, nbytes="64 MiB", folder=None, repeat=5, fresh=False):
    """Measured bytes per second of one copy route: the median of `bandwidth_runs` (same arguments)."""
    return statistics.median(bandwidth_runs(route, nbytes, folder, repeat, fresh))


def bandwidth_runs(route, nbytes="64 MiB", folder=None, repeat=5, fresh=False):
    """Bytes per second of each of `repeat` copies of one route, after one warm-up copy (a list, in order).

    route: "device->host" / "host->device": torch storage <-> numpy buffer on a CPU, GPU <-> pageable CPU
    memory on a GPU; "host->disk" / "disk->host": a numpy buffer to a file in `folder` and back (the
    operating system's page cache usually absorbs both: this is the speed of the file system's memory
    path, not of the disk); "device->pinned", "pinned->device", "device->pageable", "pageable->device":
    CUDA only (pinned = page-locked host memory, which the GPU's copy engine can read directly).
    fresh: False copies into one destination again and again (its pages already mapped); True allocates
    the destination anew for every copy, as a pack or unpack hook does (`to_host`, `from_host`), so the
    operating system maps its pages on first touch, inside the timing. Reading a file always fills a new
    buffer; writing one always overwrites the same file.
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    n = parse_bytes(nbytes, "nbytes")
    if n <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes!r}")
    repeat = count("repeat", repeat)
    if not isinstance(fresh, bool):
        raise TypeError(f"fresh must be True or False, got {fresh!r}")
    cuda = torch.cuda.is_available()
    if ("pinned" in route or "pageable" in route) and not cuda:
        raise ValueError(f"route {route!r} needs a CUDA GPU; this machine has none")
    device = "cuda" if cuda else "cpu"
    src_name, dst_name = route.split("->")
    if "disk" in route:
        if folder is None:
            raise ValueError(f"folder must name a directory for route {route!r}, got None")
        path = pathlib.Path(folder) / f"bandwidth_{os.getpid()}.bin"
        buf = np.ones(n, dtype=np.uint8)
        buf.tofile(path)
        copy = (lambda: buf.tofile(path)) if dst_name == "disk" else (lambda: np.fromfile(path, dtype=np.uint8))
        try:
            return _rates(copy, n, repeat, sync=False)
        finally:
            os.remove(path)
    pinned = "pinned" in route
    if cuda and (pinned or "pageable" in route):
        def new_host():
            return torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    else:
        def new_host():
            return torch.from_numpy(np.empty(n, dtype=np.uint8))          # a numpy buffer, outside torch

    def new_device():
        return torch.empty(n, dtype=torch.uint8, device=device)

    new_src, new_dst = (new_device, new_host) if src_name == "device" else (new_host, new_device)
    src = new_src().fill_(1)
    dst = new_dst().fill_(1)

    def copy():
        (new_dst() if fresh else dst).copy_(src, non_blocking=pinned)

    return _rates(copy, n, repeat, sync=cuda)


def _rates(copy, n, repeat, sync):
    copy()
    rates = []
    for _ in range(repeat):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        if sync:
            torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - start))
    return rates


class SeedSwapper(torch.nn.Module):
    """The seed material's swapper, as written: `x = x.cpu(); x = self.module(x); return x.cuda()`.

    Generalised to any pair of devices (`.cpu()` is `.to(host)`, `.cuda()` is `.to(device)`) so that it runs
    without a GPU, e.g. with "meta" standing in for the GPU under FakeTensorMode. It moves the input to the
    host and runs the module there: a module on `device` then fails with a device mismatch; a module on
    the host runs, with its weights, its compute and everything it saves for backward on the host, and
    only its output goes back to `device`. It moves no memory out of the device that the layer used there.
    """

    def __init__(self, module, device, host="cpu"):
        super().__init__()
        self.module, self.device, self.host = module, torch.device(device), torch.device(host)

    def forward(self, x):
        x = x.to(self.host)                 # the seed: x = x.cpu()
        x = self.module(x)                  #           x = self.module(x)
        return x.to(self.device)            #           return x.cuda()


class Swapper(torch.nn.Module):
    """What the seed's swapper was meant to do: run `layer` on `device`, keep its input and output on `host`.

    `x = x.cuda(); y = self.layer(x); return y.cpu()`, generalised to any pair of devices so that it runs
    on a CPU. It moves the layer's input and output; the layer's weights stay on `device`, and so does
    everything the layer saves for backward (saved-tensor hooks, `ActivationOffload`, move that).
    """

    def __init__(self, layer, device, host="cpu"):
        super().__init__()
        self.layer, self.device, self.host = layer, torch.device(device), torch.device(host)

    def forward(self, x, *args, **kwargs):
        y = self.layer(x.to(self.device), *args, **kwargs)
        return y.to(self.host) if isinstance(y, torch.Tensor) else type(y)(v.to(self.host) for v in y)
