"""GrowingReservation: what a generation reserves, how it grows, and when it must end."""

from __future__ import annotations

import pytest

from engine_service.api.owners import OwnerQuota
from engine_service.sessions.handles import HandleRegistry
from engine_service.sessions.reservation import STEP_ROOM, GrowingReservation, default_growth


@pytest.mark.parametrize(
    ("max_session_tokens", "growth"), [(4096, 256), (2048, 256), (512, 64), (64, 16), (8, 16)]
)
def test_default_growth(max_session_tokens, growth) -> None:
    assert default_growth(max_session_tokens) == growth  # min(256, n / 8), at least 2 * STEP_ROOM


def reservation(
    reg: HandleRegistry, *, start=10, size=20, max_new_tokens=1000, growth=32
) -> tuple[str, GrowingReservation]:
    handle = reg.register("session", "alice")
    r = GrowingReservation(
        reg,
        handle,
        start=start,
        size=size,
        max_new_tokens=max_new_tokens,
        max_session_tokens=256,
        growth=growth,
    )
    reg.weigh(handle, r.initial)
    return handle, r


def test_it_reserves_its_input_plus_one_growth_and_targets_the_session_limit() -> None:
    reg: HandleRegistry[str] = HandleRegistry()
    _, r = reservation(reg)
    assert (r.initial, r.target) == (10 + 20 + 32, 256)
    _, small = reservation(reg, max_new_tokens=5)
    assert (small.initial, small.target) == (35, 35)  # a short answer reserves only what it may reach


def test_it_grows_by_one_step_when_half_a_step_is_left() -> None:
    reg: HandleRegistry[str] = HandleRegistry()
    handle, r = reservation(reg)
    assert r.room_for_next_step(62 - 16) and r.held == 62  # 16 left = growth / 2: no growth yet
    assert r.room_for_next_step(62 - 15) and r.held == 94  # 15 left: one more step
    assert reg.usage("alice").positions == 94


def test_without_room_it_ends_only_once_fewer_than_a_step_room_are_left() -> None:
    reg: HandleRegistry[str] = HandleRegistry(quota=OwnerQuota(max_positions=70))
    handle, r = reservation(reg)  # holds 62 of 70
    assert r.room_for_next_step(62 - 15) and r.held == 70  # grew by the 8 that fit
    assert r.room_for_next_step(70 - STEP_ROOM)  # exactly a step's room: it goes on
    assert not r.room_for_next_step(70 - STEP_ROOM + 1)  # less: it must end
    assert reg.usage("alice").positions == 70  # never past the quota


def test_a_growth_below_two_step_rooms_is_refused() -> None:
    with pytest.raises(ValueError, match="growth"):
        reservation(HandleRegistry(), growth=2 * STEP_ROOM - 1)
