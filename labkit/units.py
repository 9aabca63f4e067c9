"""Bytes in and out: "2 GiB" -> 2147483648 -> "2.00 GiB"."""
from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

__all__ = ["parse_bytes", "fmt_bytes", "fmt_figure", "GiB", "MiB", "KiB"]

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}


def parse_bytes(value, name="size"):
    """Bytes from an int or a string like "64 MiB", "1.5GB"; errors name the argument and the value.

    Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024), any case except a
    lowercase b after a capital prefix ("Gb", "MiB" is fine, "Mib"): that is bits, and is refused.
    The result is a whole number of bytes, at least 1: a number or a count of bytes must be whole (`1.5` and
    "2.5 B" are refused), a string in a larger unit is rounded down to whole bytes ("1.5 KiB" is 1536, "21.6 GiB"
    is 23192823398). A string is read exactly (as a Fraction): "1.1 KB" is 1100, where 1.1 * 1000 in floats is not.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string like '2 GiB', got {value!r}")
    if isinstance(value, numbers.Real):                # int, float, numpy numbers, Fraction
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMGT]?i?B)?\s*", value, re.IGNORECASE)
        if not m:
            raise ValueError(f"{name} must look like '64 MiB' or '2 GB', got {value!r}")
        unit = m.group(2) or "B"
        if unit.endswith("b") and unit != unit.lower():
            raise ValueError(f"{name} {value!r} is in bits ('{unit}'); memory is counted in bytes: "
                             f"write '{unit[0].upper()}B' (powers of 1000) or '{unit[0].upper()}iB' (powers of 1024)")
        if not math.isfinite(float(m.group(1)) * _UNITS[unit.lower()]):   # "1e400 GB"
            raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
        n = Fraction(m.group(1)) * _UNITS[unit.lower()]
    else:
        raise TypeError(f"{name} must be a number of bytes or a string like '2 GiB', got {value!r}")
    if not math.isfinite(n):
        raise ValueError(f"{name} must be a finite number of bytes, got {value!r}")
    if n <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if not isinstance(value, str) and n != int(n):
        raise ValueError(f"{name} must be a whole number of bytes, got {value!r} (write e.g. '1.5 GiB' for a unit)")
    if n < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
    if n != int(n) and (not isinstance(value, str) or unit.lower() == "b"):   # "2.5 B": not truncated to 2
        raise ValueError(f"{name} must be a whole number of bytes, got {value!r}")
    return int(n)                                      # "21.6 GiB": its whole bytes


def fmt_bytes(n):
    """Human-readable bytes in binary units: 1536 -> '1.50 KiB'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def fmt_figure(key, value):
    """A recorded figure as text, its unit read from its name: `_bytes` in binary units, `_s` in seconds,
    `_ratio` as "x", `_gap` as a signed percentage, `_share` as a percentage; text as it is."""
    if isinstance(value, str):
        return value
    if key.endswith("_bytes"):
        return fmt_bytes(value)
    if key.endswith("_s"):
        return f"{value:.3g} s"
    if key.endswith("_ratio"):
        return f"{value:.3g}x"
    if key.endswith("_gap"):
        return f"{value:+.2%}"
    if key.endswith("_share"):
        return f"{value:.1%}"
    return f"{value:.4g}" if isinstance(value, float) else f"{value:,}"
