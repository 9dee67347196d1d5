"""The input checks that need nothing but Python: scalars, choices, optional values.

``validation`` re-exports them (every layer writes ``validation.number``), and adds the
checks that read settings or parse Dask's byte and duration strings. ``policy/`` imports
these directly, so a pure policy module pulls in no Dask (``tests/test_layout.py``).
Same contract as ``validation``: ``check(name, value, ...)`` returns the value in its
normal form or raises ``InvalidInputError`` with one line.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection
from typing import NoReturn

from .errors import InvalidInputError


def show_value(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fail(name: str, must: str, value) -> NoReturn:
    raise InvalidInputError(f"{name} must be {must}, got {show_value(value)}")


def bounds(kind: str, minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f"{kind} from {minimum} to {maximum}"
    if minimum is not None:
        return f"{kind} >= {minimum}"
    if maximum is not None:
        return f"{kind} <= {maximum}"
    return kind


def integer(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """A true integer (``int``, numpy/torch integer scalars); never a bool, float or string."""
    must = bounds("an integer", minimum, maximum)
    if isinstance(value, (bool, str, bytes)):
        fail(name, must, value)
    try:
        v = operator.index(value)
    except TypeError:
        fail(name, must, value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        fail(name, must, value)
    return v


def number(name: str, value, minimum: float | None = None, maximum: float | None = None,
           above: float | None = None) -> float:
    """A finite real number within bounds (``above``: strictly greater than)."""
    must = bounds("a number", minimum, maximum) if above is None else f"a number > {above}" + (
        f" and <= {maximum}" if maximum is not None else "")
    if isinstance(value, (bool, str, bytes)):
        fail(name, must, value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        fail(name, must, value)
    if not math.isfinite(v) or (minimum is not None and v < minimum) or (maximum is not None and v > maximum) \
            or (above is not None and v <= above):
        fail(name, must, value)
    return v


def choice(name: str, value, choices: Collection[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        fail(name, f"one of {', '.join(choices)}", value)
    return value


def optional(name: str, value, check: Callable, *args, **kwargs):
    """None stays None; anything else goes through ``check``."""
    return None if value is None else check(name, value, *args, **kwargs)
