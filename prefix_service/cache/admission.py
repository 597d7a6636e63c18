"""Whether a snapshot may be stored under a key: the checks an insert makes before the entry exists
(the cache's bounds, the handle alive at exactly that position, its content per the engine's record)."""

from __future__ import annotations

from engine_service.api.content import content_digest
from engine_service.api.errors import ForklineError, InvalidArgument
from prefix_service.cache.budget import Budget
from prefix_service.cache.outcomes import (
    CONTENT_MISMATCH,
    DISABLED,
    INVALID_KEY,
    INVALID_SNAPSHOT,
    OVER_BUDGET,
    POSITION_MISMATCH,
    PREPARED_INPUT,
    InsertRefusal,
)
from prefix_service.cache.session_backend import Handle, SessionBackend, handle_alive


def admission_refusal(
    backend: SessionBackend, budget: Budget, snapshot: Handle, key: tuple[int, ...], digest: bytes | None
) -> InsertRefusal | None:
    """Why ``snapshot`` cannot be stored under ``key`` (None: it can): a disabled cache, an empty key,
    one longer than the positions bound, a dead snapshot, another position, or content other than
    ``key`` by the engine's digest (``digest``: ``key``'s, when the caller computed it) or a
    prepared input."""
    if budget.max_entries == 0:
        return DISABLED
    if not key:
        return INVALID_KEY
    if not budget.can_ever_hold(len(key)):
        return OVER_BUDGET
    if not handle_alive(backend, snapshot):
        return INVALID_SNAPSHOT
    if _position(backend, snapshot) != len(key):
        return POSITION_MISMATCH
    return _content_refusal(backend, snapshot, key, digest)


def _content_refusal(
    backend: SessionBackend, snapshot: Handle, key: tuple[int, ...], digest: bytes | None
) -> InsertRefusal | None:
    try:
        held = backend.content_digest(snapshot)
    except ForklineError:
        return INVALID_SNAPSHOT  # it cannot say what it holds: never stored unverified
    if held is None:
        return PREPARED_INPUT
    if digest is None:
        try:
            digest = content_digest(key)
        except InvalidArgument:
            return CONTENT_MISMATCH  # ids past int32 are no session's content
    return None if held == digest else CONTENT_MISMATCH


def _position(backend: SessionBackend, snapshot: Handle) -> int | None:
    try:
        return backend.position(snapshot)
    except ForklineError:
        return None
