"""The engine's answers about one session, as values: a clone or why not, a description, an import.
Handles are opaque (a handle string over the wire, an in-process Session); enum values are wire names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
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
    """The new ``handle`` and its content digest, or None with ``refusal`` (and ``detail`` in words)."""

    handle: Any | None
    refusal: CloneRefusal | None = None
    content_digest: bytes | None = None
    detail: str = ""


@dataclass(frozen=True)
class Described:
    """A session's committed ``position``, its digest (None while generating) and ``generating``."""

    position: int
    content_digest: bytes | None = None
    generating: bool = False


@dataclass(frozen=True)
class ImportedSnapshot:
    """The importer's new ``handle``, or None with ``refusal`` (a ``LoadRefusal`` value)."""

    handle: str | None
    refusal: str = ""
    detail: str = ""
    positions: int = 0
    content_digest: bytes | None = None
    extra: Mapping[str, str] = field(default_factory=dict)


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
    return _REFUSAL_TEXT[reason].format(upto=upto)


def close_child_when_done(future: Future, close: Callable[[Any], object] | None = None) -> None:
    """Close the child of a clone future nobody will receive, once it settles."""

    def on_done(done: Future) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        child = done.result()
        if child is None:
            return
        if close is None:
            child.close()
        else:
            close(child)

    future.add_done_callback(on_done)
