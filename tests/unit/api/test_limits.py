"""The engine's input rules (``engine_service/api/limits.py``): each boundary where the docstring puts it,
each refusal an InvalidArgument whose message names the field and the offending value."""

from __future__ import annotations

import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.api.limits import (
    EngineLimits,
    check_breakpoints,
    check_fits,
    check_nonempty,
    check_tokens,
    out_of_vocab,
)

# (start, size, max_session_tokens, fits): the session holds positions [0, max_session_tokens)
FITS = [
    (0, 8, 8, True),
    (0, 9, 8, False),
    (5, 3, 8, True),
    (5, 4, 8, False),
    (8, 0, 8, True),
    (0, 0, 1, True),
]
# (start, size, breakpoint, inside): breakpoints lie in (start, start + size]
INSIDE = [
    (0, 4, 1, True),
    (0, 4, 4, True),
    (0, 4, 0, False),
    (0, 4, 5, False),
    (10, 2, 10, False),
    (10, 2, 12, True),
]


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(InvalidArgument) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def test_engine_limits_take_positive_ints_and_name_the_bad_field() -> None:
    limits = EngineLimits(max_sessions=2, max_session_tokens=64, vocab_size=128)
    assert (limits.max_sessions, limits.max_session_tokens, limits.vocab_size) == (2, 64, 128)
    for field in ("max_sessions", "max_session_tokens", "vocab_size"):
        good = {"max_sessions": 1, "max_session_tokens": 1, "vocab_size": 1}
        assert refusal(EngineLimits, **{**good, field: 0}) == f"{field} must be >= 1, got 0"
        assert refusal(EngineLimits, **{**good, field: True}) == f"{field} must be an int, got True"


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [((), None), ((0, 5, 9), None), ((0, 10), 1), ((-1, 3), 0), ((3, 4, 12, -2), 2)],
)
def test_out_of_vocab_finds_the_first_bad_id(tokens, expected) -> None:
    assert out_of_vocab(tokens, 10) == expected


def test_check_tokens_returns_a_list_or_names_the_first_bad_index() -> None:
    assert check_tokens((0, 9, 3), 10) == [0, 9, 3]
    assert refusal(check_tokens, [1, 2, 10, -1], 10) == "tokens[2] = 10 is outside the vocabulary [0, 10)"
    assert (
        refusal(check_tokens, [-3], 10, "stop_tokens")
        == "stop_tokens[0] = -3 is outside the vocabulary [0, 10)"
    )


def test_check_nonempty() -> None:
    check_nonempty(1)
    assert refusal(check_nonempty, 0) == "input is empty"
    assert refusal(check_nonempty, 0, "suffix") == "suffix is empty"


@pytest.mark.parametrize(("start", "size", "limit", "fits"), FITS)
def test_check_fits_at_its_boundary(start, size, limit, fits) -> None:
    if fits:
        check_fits(start, size, limit)
    else:
        message = refusal(check_fits, start, size, limit, "prompt")
        assert message == f"prompt of {size} positions at position {start} exceeds max_session_tokens={limit}"


@pytest.mark.parametrize(("start", "size", "point", "inside"), INSIDE)
def test_check_breakpoints_at_their_boundaries(start, size, point, inside) -> None:
    if inside:
        check_breakpoints(start, size, [point])
    else:
        message = refusal(check_breakpoints, start, size, [start + 1, point])
        assert (
            message
            == f"capture.breakpoints: {point} is outside the input's positions ({start}, {start + size}]"
        )


def test_control_the_boundary_tables_tell_an_off_by_one_apart() -> None:
    """An off-by-one copy of each rule disagrees with its table, so the tests above can fail."""
    assert any((start + size >= limit) != (not fits) for start, size, limit, fits in FITS)
    assert any((start <= point <= start + size) != inside for start, size, point, inside in INSIDE)
    assert any((start < point < start + size) != inside for start, size, point, inside in INSIDE)
