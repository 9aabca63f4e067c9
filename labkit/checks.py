"""Argument checks for all of labkit: errors that name the argument and the value, before any work is done.

One wording for every count: "NAME must be an int >= MINIMUM, got VALUE" (numpy integers welcome; a bool, a
float, even 2.0, or a string refused).
"""
from __future__ import annotations

import math
import numbers
import operator

__all__ = ["count", "flag", "index", "number", "power_of_two"]


def _int(value):
    """value as an int if it is one (numpy integers too; not a bool, not a tensor), else None."""
    if isinstance(value, bool) or hasattr(value, "ndim") and not isinstance(value, numbers.Integral):   # a tensor
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def count(name, value, minimum=1):
    """An int >= minimum (numpy integers welcome), else a ValueError naming the argument."""
    n = _int(value)
    if n is None or n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return n


def index(name, value, size):
    """An int in [0, size) (numpy integers welcome), else a ValueError naming the argument and the range."""
    n = _int(value)
    if n is None or not 0 <= n < size:
        raise ValueError(f"{name} must be an int in [0, {size}), got {value!r}")
    return n


def number(name, value, minimum=0):
    """A finite real number >= minimum (numpy's too; not a bool), as a float, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value!r}")
    return float(value)


def flag(name, value):
    """A bool (numpy's too), else a ValueError: the string "False" is truthy and would mean True."""
    if not (isinstance(value, bool) or type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def power_of_two(name, value, minimum=1, why=""):
    """A power of two >= minimum (numpy integers welcome; Triton's tiles and tl.arange need one), else a
    ValueError naming the argument; `why` says whose rule it is, e.g. " (tl.dot's smallest tile)"."""
    try:
        n = count(name, value, minimum)
    except ValueError:
        n = 0
    if n < max(minimum, 1) or n & (n - 1):
        at_least = f" >= {minimum}" if minimum > 1 else ""
        raise ValueError(f"{name} must be a power of two{at_least}{why}, got {value!r}")
    return n
