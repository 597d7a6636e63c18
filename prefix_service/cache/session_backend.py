"""What the prefix cache needs from an engine: clone, close and inspect opaque session handles.

The in-process adapter (``engine_service/sessions/local_backend.py``) uses engine Session objects as
handles, the remote one (``prefix_service/engines/engine_backend.py``) engine handle strings. Both
publish the engine ``fingerprint``, part of every cache key. ``clone`` blocks until the engine answers:
never call it on the engine thread (from a generation callback); ``clone_async`` only queues.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

from engine_service.api.answers import TakenClone
from engine_service.api.errors import ForklineError

Handle = Any


@runtime_checkable
class SessionBackend(Protocol):
    """Clone / close / inspect opaque session handles.

    ``clone(handle, upto)``: a new, independent handle holding exactly ``[0, upto)`` of ``handle``, or
    None when refused (boundary unavailable, no room, stopping). A refusal never changes ``handle``.
    ``close(handle)``: release it; closing an already-closed or dead handle is a no-op.
    ``position(handle)``: committed positions. ``valid(handle)``: False once closed or its engine died.
    ``content_digest(handle)``: the engine's ``content.content_digest`` of the token ids the handle's
    committed positions hold (the engine's own record, never the caller's word); None when they hold
    a prepared input. ``fingerprint``: engine model + configuration identity (part of every cache key).
    """

    @property
    def fingerprint(self) -> str: ...

    def clone(self, handle: Handle, upto: int) -> Handle | None: ...

    def close(self, handle: Handle) -> None: ...

    def position(self, handle: Handle) -> int: ...

    def valid(self, handle: Handle) -> bool: ...

    def content_digest(self, handle: Handle) -> bytes | None: ...


@runtime_checkable
class CaptureBackend(SessionBackend, Protocol):
    """A backend that can queue a clone from inside a generation callback (prompt capture).

    ``clone_async(handle, upto)`` enqueues the clone and returns at once; the future settles with the
    new handle or None. Dropping the future unresolved must release a successful child.
    """

    def clone_async(self, handle: Handle, upto: int) -> Future: ...


def clone_with_refusal(backend: SessionBackend, handle: Handle, upto: int) -> TakenClone:
    """``backend.clone``, with the engine's reason when it refused: a backend that can say why
    implements ``clone_or_refusal(handle, upto) -> TakenClone`` (the in-process and the remote
    engine do); any other answers ``TakenClone(child)`` / ``TakenClone(None)``."""
    says_why = getattr(backend, "clone_or_refusal", None)
    if says_why is not None:
        return says_why(handle, upto)
    return TakenClone(backend.clone(handle, upto))


def max_rewind(backend: SessionBackend) -> int | None:
    """How far below a snapshot's own length a clone of it can reach on this backend's engine:
    ``max_write`` when its cache evicts sliding-window rows (``batched-sequence`` with sliding layers:
    the clone floor is the snapshot's high-water mark, at least its length, minus ``max_write``), None
    when any committed position can be cloned (``batched-cell``, no sliding layers) or the backend
    does not say (its optional ``max_rewind`` attribute)."""
    value = getattr(backend, "max_rewind", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


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
