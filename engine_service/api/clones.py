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
