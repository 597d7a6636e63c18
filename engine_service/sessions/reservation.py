"""The positions a generation holds in its owner's quota: its input plus one growth step, grown as it
produces tokens; with no room left it ends ``length`` (as llama.cpp's server does with a full context).
Spec: docs/SECURITY.md (per-owner quotas on the engine).
"""

from __future__ import annotations

from typing import Any

from engine_service.sessions.handles import HandleRegistry

GROWTH = 256  # positions a generation reserves beyond its input, and adds each time it runs low
# Reserved positions a decode step may need: the served executors commit one position a step (a
# speculative one at most 1 + its drafts, fewer than this); below it the generation must grow or end.
STEP_ROOM = 8


def default_growth(max_session_tokens: int) -> int:
    """:data:`GROWTH`, ``max_session_tokens / 8`` on engines of short sessions, at least 2 step rooms."""
    return max(2 * STEP_ROOM, min(GROWTH, max_session_tokens // 8))


class GrowingReservation:
    """One generation's weight under ``handle``: :attr:`initial` at the start (``start + size +
    min(max_new_tokens, growth)``), grown toward :attr:`target` by :meth:`room_for_next_step`."""

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
        """Engine thread, after each update: grow by one step when half a step is left; False (end now)
        when fewer than :data:`STEP_ROOM` are left and nothing more fits."""
        if self.held >= self.target or self.held - position >= self._growth // 2:
            return True
        got = self._registry.extend(self._handle, min(self.target, self.held + self._growth))
        if got is None:  # the handle is gone: the call is ending anyway
            return True
        self.held = got
        return got >= self.target or got - position >= STEP_ROOM
