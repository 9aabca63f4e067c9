"""labkit: measure, estimate, guard and plot the memory of deep-learning models (GPU Memory Lab)."""
from . import data, models, paged, plot
from .bench import Result, Table, compare, measure
from .device import device, has, report, size
from .estimate import Estimate, estimate, kv_cache_bytes, param_count
from .guard import budget, free, oom_guard, requires
from .memory import CATEGORIES, track
from .records import record
from .units import GiB, KiB, MiB, fmt_bytes, parse_bytes

__all__ = [
    "data", "models", "paged", "plot", "widgets",
    "device", "size", "has", "report",
    "track", "CATEGORIES",
    "estimate", "Estimate", "param_count", "kv_cache_bytes",
    "oom_guard", "budget", "free", "requires",
    "measure", "compare", "Result", "Table",
    "record", "parse_bytes", "fmt_bytes", "KiB", "MiB", "GiB",
]


def __getattr__(name):
    if name == "widgets":                 # ipywidgets is heavy and optional: import on first use
        import importlib
        return importlib.import_module(".widgets", __name__)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
