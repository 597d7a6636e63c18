"""Range checks (``engine_service/api/checks.py``): what each helper accepts and returns, and the one
message shape of a refusal: ``<field> must be <bounds>, got <value>``."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.api.checks import checked_float, checked_int
from engine_service.api.errors import InvalidArgument

# (value, lo_open, accepted) for bounds lo=0.0, hi=1.0
UNIT_INTERVAL = [
    (0.0, False, True),
    (0.0, True, False),
    (1e-9, True, True),
    (1.0, True, True),
    (1.0 + 1e-9, False, False),
]


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(InvalidArgument) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def test_checked_int_returns_an_int_inside_its_bounds() -> None:
    assert checked_int("n", 3, lo=3, hi=3) == 3
    value = checked_int("n", np.int64(7), lo=0)  # any integer type with __index__
    assert value == 7 and type(value) is int
    assert checked_int("n", -(2**70)) == -(2**70)  # no bound: no limit


@pytest.mark.parametrize(
    ("value", "lo", "hi", "message"),
    [
        (0, 1, None, "n must be >= 1, got 0"),
        (6, None, 5, "n must be <= 5, got 6"),
        (0, 1, 5, "n must be in [1, 5], got 0"),
        (6, 1, 5, "n must be in [1, 5], got 6"),
        (True, 0, None, "n must be an int, got True"),
        (1.0, 0, None, "n must be an int, got 1.0"),
        ("2", None, None, "n must be an int, got '2'"),
    ],
)
def test_checked_int_refusals_name_the_field_and_value(value, lo, hi, message) -> None:
    assert refusal(checked_int, "n", value, lo=lo, hi=hi) == message


def test_checked_float_returns_a_float_inside_its_bounds() -> None:
    value = checked_float("t", 2, lo=0.0)
    assert value == 2.0 and type(value) is float
    assert checked_float("t", -1e300) == -1e300


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), True, "0.5", None])
def test_checked_float_refuses_what_is_not_a_finite_number(value) -> None:
    assert refusal(checked_float, "top_p", value) == f"top_p must be a finite number, got {value!r}"


@pytest.mark.parametrize(("value", "lo_open", "accepted"), UNIT_INTERVAL)
def test_checked_float_bounds_open_and_closed(value, lo_open, accepted) -> None:
    if accepted:
        assert checked_float("top_p", value, lo=0.0, hi=1.0, lo_open=lo_open) == value
    else:
        bounds = f"{'(' if lo_open else '['}0.0, 1.0]"
        message = refusal(checked_float, "top_p", value, lo=0.0, hi=1.0, lo_open=lo_open)
        assert message == f"top_p must be in {bounds}, got {value!r}"


def test_one_sided_float_bounds_read_as_comparisons() -> None:
    assert refusal(checked_float, "x", 0.0, lo=0.0, lo_open=True) == "x must be > 0.0, got 0.0"
    assert refusal(checked_float, "x", -0.5, lo=0.0) == "x must be >= 0.0, got -0.5"
    assert refusal(checked_float, "x", 2.5, hi=2.0) == "x must be <= 2.0, got 2.5"


def test_control_the_interval_table_tells_open_from_closed() -> None:
    """A copy that ignores ``lo_open`` disagrees with the table, so the bounds test can fail."""
    assert any((0.0 <= value <= 1.0) != accepted for value, _, accepted in UNIT_INTERVAL)
