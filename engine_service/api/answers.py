"""The engine's answers about one session, as values: a clone (:class:`TakenClone`, or why not:
:class:`CloneRefusal`), a description (:class:`Described`) and an import (:class:`ImportedSnapshot`);
:func:`close_child_when_done` releases a clone nobody will receive.

Handles are opaque to readers: an engine session handle string over the wire, or an in-process
Session. The enum values are the wire names (``CLONE_REFUSAL_<NAME>`` in ``engine.proto``), lower case.
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
    """A clone's answer: the new ``handle`` and the digest of what it holds (None: a prepared input,
    or not reported), or None and why the engine refused (``refusal`` None: it did not say;
    ``detail``: in words, when more specific than :func:`refusal_text`)."""

    handle: Any | None
    refusal: CloneRefusal | None = None
    content_digest: bytes | None = None
    detail: str = ""


@dataclass(frozen=True)
class Described:
    """A session as the engine describes it: its committed ``position``, whether it is generating,
    and the digest of what it holds (None while it generates, or when it holds a prepared input)."""

    position: int
    content_digest: bytes | None = None
    generating: bool = False


@dataclass(frozen=True)
class ImportedSnapshot:
    """An imported snapshot file: the new ``handle`` (owned by the importer) holding ``positions`` with
    ``content_digest``, and the ``extra`` strings the file carried; or None and the engine's
    ``refusal`` (a ``LoadRefusal`` value: "checksum", "fingerprint", "no_room", ...) and ``detail``."""

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
    """``reason`` in words, for a clone at ``upto``."""
    return _REFUSAL_TEXT[reason].format(upto=upto)


def close_child_when_done(future: Future, close: Callable[[Any], object] | None = None) -> None:
    """Close the child a clone future produces once the future settles (now, if it already has).

    For a clone future nobody will receive (its caller gave up or timed out): a refusal (None), a
    failure or a cancellation leaves nothing to close. ``close(child)`` closes it; the default is
    ``child.close()`` (an engine Session); a backend passes its own for the handles it hands out.
    """

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
