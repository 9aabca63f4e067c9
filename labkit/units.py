"""Bytes in and out: "2 GiB" -> 2147483648 -> "2.00 GiB"."""
from __future__ import annotations

import re

__all__ = ["parse_bytes", "fmt_bytes", "GiB", "MiB", "KiB"]

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}


def parse_bytes(value, name="size"):
    """Bytes from an int or a string like "64 MiB", "1.5GB"; errors name the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string like '2 GiB', got {value!r}")
    if isinstance(value, (int, float)):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B)?\s*", value, re.IGNORECASE)
        if not m:
            raise ValueError(f"{name} must look like '64 MiB' or '2 GB', got {value!r}")
        n = float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()]
    else:
        raise TypeError(f"{name} must be a number of bytes or a string like '2 GiB', got {value!r}")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return int(n)


def fmt_bytes(n):
    """Human-readable bytes in binary units: 1536 -> '1.50 KiB'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
