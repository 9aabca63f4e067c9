"""labkit: measure, estimate, guard and plot the memory of deep-learning models (GPU Memory Lab)."""
from . import data, models, paged, plot
from .bench import Result, Table, compare, measure
from .device import CARD, HEADROOM, LIMIT, device, has, report, size
from .exercise import exercise, nontrivial, reveal
from .estimate import Estimate, Parallel, estimate, kv_cache_bytes, param_count
from .guard import budget, free, oom_guard, requires
from .memory import CATEGORIES, track
from .plan import plan
from .records import record
from .show import show
from .units import GiB, KiB, MiB, fmt_bytes, parse_bytes

__all__ = [
    "data", "models", "paged", "plot", "widgets",
    "device", "size", "has", "report", "CARD", "HEADROOM", "LIMIT",
    "track", "CATEGORIES",
    "estimate", "Estimate", "Parallel", "param_count", "kv_cache_bytes", "plan",
    "oom_guard", "budget", "free", "requires",
    "measure", "compare", "Result", "Table",
    "exercise", "nontrivial", "reveal",
    "record", "show", "parse_bytes", "fmt_bytes", "KiB", "MiB", "GiB",
]


# Imported on first use (`lk.alloc`, `lk.widgets`, ...): heavy or optional dependencies, and modules that
# only some notebooks need.
LAZY = {"widgets", "alloc", "leaks", "offload", "copies", "zero", "engines", "kernels", "profiling", "flash", "tensor_parallel",
        "pipeline_parallel", "oplog", "course", "launch", "collectives", "workbook"}


def __getattr__(name):
    if name in LAZY:
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
