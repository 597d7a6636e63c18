"""The positions a generation holds in its owner's quota, and how they grow as it produces tokens.

A generation starting at ``start`` (the session's position, plus its pending token) with ``input``
positions may reach ``start + input + max_new_tokens``, at most ``max_session_tokens``: its *target*.
It does not hold all of that from the start (a request without a token limit would hold a whole
session): it reserves ``start + input + min(max_new_tokens, growth)`` and, whenever fewer than
``growth / 2`` reserved positions are left ahead of its committed position, asks for ``growth`` more
(never past the target), or for whatever room its owner's quota still has. When fewer than
:data:`STEP_ROOM` reserved positions are left and nothing more fits, the generation ends with finish
reason ``length``: its tokens so far are its answer (llama.cpp's server truncates the same way when
its context is full), no other request fails, and the owner never holds more than its quota.

``growth`` defaults to :func:`default_growth`: :data:`GROWTH` (256) positions, ``max_session_tokens / 8``
on an engine of short sessions, at least ``2 * STEP_ROOM``.
"""

from __future__ import annotations

from typing import Any

from engine_service.sessions.handles import HandleRegistry

GROWTH = 256  # positions a generation reserves beyond its input, and adds each time it runs low
# Reserved positions a decode step may need: the served executors commit one position a step (a
# speculative one at most 1 + its drafts, fewer than this); below it the generation must grow or end.
STEP_ROOM = 8


def default_growth(max_session_tokens: int) -> int:
    """The growth step of an engine whose sessions hold ``max_session_tokens`` positions."""
    return max(2 * STEP_ROOM, min(GROWTH, max_session_tokens // 8))


class GrowingReservation:
    """The weight of one generation's session in ``registry`` under ``handle`` (module docstring).

    :attr:`initial` is what the generation reserves when it starts (the caller weighs the handle with
    it); :meth:`room_for_next_step` runs on the engine thread after each update and extends it.
    """

    def __init__(
        self,
        registry: HandleRegistry[Any],
        handle: str,
        *,
        start: int,
        size: int,
        max_new_tokens: int,
        max_session_tokens: int,
        growth: int,
    ) -> None:
        if growth < 2 * STEP_ROOM:
            raise ValueError(f"growth must be >= {2 * STEP_ROOM}, got {growth}")
        self._registry = registry
        self._handle = handle
        self._growth = growth
        self.target = min(start + size + max_new_tokens, max_session_tokens)
        self.initial = min(start + size + min(max_new_tokens, growth), self.target)
        self.held = self.initial

    def room_for_next_step(self, position: int) -> bool:
        """After an update left the session at committed ``position``: extend the reservation when it
        runs low; False when fewer than :data:`STEP_ROOM` positions are left and nothing more fits (the
        generation must end now)."""
        if self.held >= self.target or self.held - position >= self._growth // 2:
            return True
        got = self._registry.extend(self._handle, min(self.target, self.held + self._growth))
        if got is None:  # the handle is gone: the call is ending anyway
            return True
        self.held = got
        return got >= self.target or got - position >= STEP_ROOM
