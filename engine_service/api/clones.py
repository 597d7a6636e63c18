"""A clone's answer: the new session handle, or why the engine refused (:class:`CloneRefusal`).

The enum values are the wire names (``CLONE_REFUSAL_<NAME>`` in ``engine.proto``), lower case.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class CloneRefusal(StrEnum):
    """Why a clone produced no session."""

    POSITION = "position"  # upto is outside [0, committed position] when the engine runs the clone
    BOUNDARY = "boundary"  # the executor refused: no free slot, no room, or it raised
    WINDOW = "window"  # upto is below the source's ring floor (sliding window): the rows are gone
    CONTENT_MISMATCH = "content_mismatch"  # [0, upto) does not hold the expected content
    PREPARED_INPUT = "prepared_input"  # an expected digest was given and [0, upto) holds a prepared input
    SOURCE_UNUSABLE = "source_unusable"  # the source is closed or failed
    STOPPING = "stopping"  # the runner is stopping
    QUOTA = "quota"  # the snapshot's owner has no room left in its quota


@dataclass(frozen=True)
class TakenClone:
    """A clone's answer: the new ``handle`` (a backend's opaque handle: an engine session handle string,
    or an in-process Session), or None and why the engine refused (``refusal`` None: it did not say)."""

    handle: Any | None
    refusal: CloneRefusal | None = None


_REFUSAL_TEXT = {
    CloneRefusal.POSITION: "upto={upto} is past the session's committed position",
    CloneRefusal.BOUNDARY: "the engine refused to clone at position {upto} (boundary unavailable or no room)",
    CloneRefusal.CONTENT_MISMATCH: "[0, {upto}) does not hold the content expected_content_digest names",
    CloneRefusal.PREPARED_INPUT: "[0, {upto}) holds a prepared input, which has no token content digest",
    CloneRefusal.SOURCE_UNUSABLE: "the session is closed or failed",
    CloneRefusal.STOPPING: "the engine is stopping",
    CloneRefusal.QUOTA: "the snapshot's owner has no room left in its quota",
    CloneRefusal.WINDOW: "position {upto} is below the session's sliding-window floor (the ring no longer holds "
    "the rows)",
}


def refusal_text(reason: CloneRefusal, upto: int) -> str:
    """``reason`` in words, for a clone at ``upto``."""
    return _REFUSAL_TEXT[reason].format(upto=upto)
