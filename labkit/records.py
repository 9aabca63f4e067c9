"""Headline figures a notebook measured, saved as JSON for `make workbook`'s index."""
from __future__ import annotations

import datetime
import json
import numbers
import os
import pathlib
import re

import torch

from .device import size

__all__ = ["record", "RECORDS_DIR"]

RECORDS_DIR = pathlib.Path(os.environ.get(
    "LABKIT_RECORDS", pathlib.Path(__file__).resolve().parent.parent / "build" / "records"))


def record(notebook, **figures):
    """Save `figures` (name=number or short text) under the notebook's name; returns the file's path.

    Names ending in `_bytes` are shown in binary units, `_s` in seconds, `_ratio` as "x", `_gap` as a
    signed percentage, `_share` as a percentage.
    """
    if not isinstance(notebook, str) or not re.fullmatch(r"[0-9]{2}_[a-z0-9_]+", notebook):
        raise ValueError(f"notebook must be a name like '01_memory_anatomy', got {notebook!r}")
    if not figures:
        raise ValueError("record needs at least one figure, like record('01_x', peak_bytes=123)")
    clean = {}
    for key, value in figures.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
            raise TypeError(f"figure {key} must be a number or a string, got {value!r}")
        clean[key] = value if isinstance(value, str) else float(value) if isinstance(value, float) else int(value)
    RECORDS_DIR.mkdir(parents=True, exist_ok=True)
    path = RECORDS_DIR / f"{notebook}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    entry = {"size": size(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "torch": torch.__version__, "when": datetime.datetime.now().isoformat(timespec="seconds"),
             "figures": {**previous.get("figures", {}), **clean} if previous.get("size") == size() else clean}
    path.write_text(json.dumps(entry, indent=1))
    return path
