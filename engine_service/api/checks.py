"""Range checks for public inputs: one helper per kind of value, one message shape naming the field."""

from __future__ import annotations

import math
import operator

from engine_service.api.errors import InvalidArgument


def checked_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (either bound optional; bools refused), else InvalidArgument."""
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an int, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError as exc:
        raise InvalidArgument(f"{name} must be an int, got {value!r}") from exc
    if (lo is not None and out < lo) or (hi is not None and out > hi):
        raise InvalidArgument(f"{name} must be {_bounds(lo, hi)}, got {out}")
    return out


def checked_float(
    name: str, value: object, lo: float | None = None, hi: float | None = None, *, lo_open: bool = False
) -> float:
    """``value`` as a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), else InvalidArgument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    out = float(value)
    below = lo is not None and (out <= lo if lo_open else out < lo)
    if below or (hi is not None and out > hi):
        raise InvalidArgument(f"{name} must be {_bounds(lo, hi, lo_open)}, got {value!r}")
    return out


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}"
