"""What the prefix cache needs from an engine: clone, close and inspect opaque session handles (engine
Session objects in process, handle strings over gRPC). ``clone`` blocks: never on the engine thread."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from engine_service.api.answers import TakenClone
from engine_service.api.errors import ForklineError

Handle = Any


@runtime_checkable
class SessionBackend(Protocol):
    @property
    def fingerprint(self) -> str: ...  # the engine's model + configuration identity (in every cache key)

    # a new, independent handle holding exactly [0, upto) of ``handle``; None when refused (boundary,
    # room, stopping), which never changes ``handle``
    def clone(self, handle: Handle, upto: int) -> Handle | None: ...

    def close(self, handle: Handle) -> None: ...  # a closed or dead handle: a no-op

    def position(self, handle: Handle) -> int: ...  # committed positions

    def valid(self, handle: Handle) -> bool: ...  # False once closed or its engine died

    # the engine's own record of what the committed positions hold (``content.content_digest`` of
    # their ids), never the caller's word; None: a prepared input
    def content_digest(self, handle: Handle) -> bytes | None: ...


@runtime_checkable
class CaptureBackend(SessionBackend, Protocol):
    """A backend that can queue a clone from a generation callback: the future settles with the new
    handle or None; dropping it unresolved must release a successful child."""

    def clone_async(self, handle: Handle, upto: int) -> Future: ...


def clone_with_refusal(backend: SessionBackend, handle: Handle, upto: int) -> TakenClone:
    """``backend.clone``, with the engine's reason when it refused (``clone_or_refusal``, where the
    backend has it)."""
    says_why = getattr(backend, "clone_or_refusal", None)
    if says_why is not None:
        return says_why(handle, upto)
    return TakenClone(backend.clone(handle, upto))


def max_rewind(backend: SessionBackend) -> int | None:
    """How far below a snapshot's length a clone of it can reach on this backend's engine: ``max_write``
    where its cache evicts sliding-window rows, None where any position can be cloned (or unsaid)."""
    value = getattr(backend, "max_rewind", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def clone_shared_share(backend: SessionBackend) -> float:
    """``backend.clone_shared_share`` where it says it: the share in [0, 1] of a position's bytes a
    clone shares with its source (so entries cloned from each other hold that share of a common prefix
    once); unsaid or not a number: 0, a whole copy each."""
    value = getattr(backend, "clone_shared_share", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    return min(1.0, max(0.0, float(value)))


def clone_shared_ring_positions(backend: SessionBackend) -> int:
    """``backend.clone_shared_ring_positions``: entries no longer share every layer (0: unsaid)."""
    value = getattr(backend, "clone_shared_ring_positions", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def handle_alive(backend: SessionBackend, handle: Handle) -> bool:
    """``backend.valid(handle)``; a failing engine call (e.g. the engine stopped) counts as dead."""
    try:
        return bool(backend.valid(handle))
    except ForklineError:
        return False


def release_handle(backend: SessionBackend, handle: Handle) -> None:
    """Close ``handle``; one already gone with its engine has nothing left to release."""
    with contextlib.suppress(ForklineError):
        backend.close(handle)
