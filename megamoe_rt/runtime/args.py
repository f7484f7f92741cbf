"""Checks of scalar arguments of the public API, one wording for every entry point: a wrong
type is a TypeError, a value outside its range a ValueError, both naming the argument."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np


def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int (Python or NumPy integers; not bool, not float)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer, got the bool {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name}={out}: expected an integer >= {minimum}")
    if maximum is not None and out > maximum:
        raise ValueError(f"{name}={out}: expected an integer <= {maximum}")
    return out


def integer_choice(name: str, value: Any, choices: Iterable[int]) -> int:
    """``value`` as an int that is one of ``choices``."""
    allowed = tuple(choices)
    out = integer(name, value)
    if out not in allowed:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, allowed))}, got {out}")
    return out


def positive_float32(name: str, value: Any) -> float:
    """A real number (not bool or str) that is finite and stays positive in float32, where the
    kernels use it (a limit of 1e-50 would become 0 there)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    out = float(value)
    if not (math.isfinite(out) and out > 0):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    if not (np.float32(out) > 0 and np.isfinite(np.float32(out))):
        raise ValueError(f"{name}={value!r}: expected a value that float32 holds as positive and finite")
    return out
