"""Argument checks for all of labkit: errors that name the argument and the value, before any work is done."""
from __future__ import annotations

import operator

__all__ = ["count", "flag"]


def count(name, value, minimum=1):
    """An int >= minimum (numpy integers welcome), else a ValueError naming the argument."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if n < minimum:
        word = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {word}, got {value!r}")
    return n


def flag(name, value):
    """A bool (numpy's too), else a ValueError: the string "False" is truthy and would mean True."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)

