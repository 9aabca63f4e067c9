"""Headline figures a notebook measured, saved as JSON for `make workbook`'s index."""
from __future__ import annotations

import datetime
import json
import math
import numbers
import os
import pathlib
import re

import torch

from .device import size

__all__ = ["record", "RECORDS_DIR"]

RECORDS_DIR = pathlib.Path(os.environ.get(
    "LABKIT_RECORDS", pathlib.Path(__file__).resolve().parent.parent / "build" / "records"))


def _clean(key, value):
    """A JSON-safe figure: ints stay exact, other reals become floats, NaN/inf become the text 'nan'/'inf'."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if hasattr(value, "item") and not isinstance(value, (str, bool)) and getattr(value, "shape", None) == ():
        value = value.item()                      # numpy scalars: np.float32(2.5) -> 2.5
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"figure {key} must be a number or a string, got {value!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)                          # Fraction(1, 3) -> 0.333..., not 0
    return value if math.isfinite(value) else str(value)     # standard JSON has no NaN or Infinity


def _previous(path):
    """The record already saved, or {} if there is none or it is unreadable (then kept aside, said so)."""
    if not path.exists():
        return {}
    try:
        previous = json.loads(path.read_text())
        if isinstance(previous, dict):
            return previous
        problem = f"holds a {type(previous).__name__}, not a record"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"is not valid JSON ({e})"
    backup = path.with_name(f"{path.name}.corrupt-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    path.replace(backup)
    print(f"record: {path} {problem}; kept it as {backup.name} and started a fresh record.")
    return {}


def record(notebook, **figures):
    """Save `figures` (name=number or short text) under the notebook's name; returns the file's path.

    Names ending in `_bytes` are shown in binary units, `_s` in seconds, `_ratio` as "x", `_gap` as a
    signed percentage, `_share` as a percentage. Integers are kept exact, other numbers (numpy,
    Fraction, 0-d tensors) as floats; NaN and infinities are saved as the text "nan"/"inf" (standard
    JSON has no such numbers). A record file that cannot be read is set aside and replaced.
    """
    if not isinstance(notebook, str) or not re.fullmatch(r"[0-9]{2}_[a-z0-9_]+", notebook):
        raise ValueError(f"notebook must be a name like '01_memory_anatomy', got {notebook!r}")
    if not figures:
        raise ValueError("record needs at least one figure, like record('01_x', peak_bytes=123)")
    clean = {key: _clean(key, value) for key, value in figures.items()}
    RECORDS_DIR.mkdir(parents=True, exist_ok=True)
    path = RECORDS_DIR / f"{notebook}.json"
    previous = _previous(path)
    old = previous.get("figures") if previous.get("size") == size() else None
    entry = {"size": size(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "torch": torch.__version__, "when": datetime.datetime.now().isoformat(timespec="seconds"),
             "figures": {**old, **clean} if isinstance(old, dict) else clean}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")     # write, then rename: never half a file
    tmp.write_text(json.dumps(entry, indent=1, allow_nan=False))
    tmp.replace(path)
    return path
