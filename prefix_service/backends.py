"""SessionBackend: what the prefix cache needs from an engine, and the in-process adapter over a Runner.

The prefix cache treats snapshot handles as opaque: it only clones, closes and inspects them through
a backend. The in-process adapter (:class:`RunnerBackend`) uses :class:`engine_service.runtime.session.Session`
objects as handles; the remote adapter (``prefix_service/rpc/engine_backend.py``) uses engine session
handle strings over gRPC. Both publish the engine ``fingerprint`` so cache keys never cross models or
execution configurations.

Threading: ``clone`` blocks until the engine answers, so it must never run on the engine thread
(never from a generation callback). ``clone_async`` only queues and is safe there.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # runtime import would tie the prefix cache to the engine package layout
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session

Handle = Any


@runtime_checkable
class SessionBackend(Protocol):
    """Clone / close / inspect opaque session handles.

    ``clone(handle, upto)``: a new, independent handle holding exactly ``[0, upto)`` of ``handle``, or
    None when refused (boundary unavailable, no room, stopping). A refusal never changes ``handle``.
    ``close(handle)``: release it; closing an already-closed or dead handle is a no-op.
    ``position(handle)``: committed positions. ``valid(handle)``: False once closed or its engine died.
    ``fingerprint``: engine model + configuration identity (part of every cache key).
    """

    @property
    def fingerprint(self) -> str: ...

    def clone(self, handle: Handle, upto: int) -> Handle | None: ...

    def close(self, handle: Handle) -> None: ...

    def position(self, handle: Handle) -> int: ...

    def valid(self, handle: Handle) -> bool: ...


@runtime_checkable
class CaptureBackend(SessionBackend, Protocol):
    """A backend that can queue a clone from inside a generation callback (prompt capture).

    ``clone_async(handle, upto)`` enqueues the clone and returns at once; the future settles with the
    new handle or None. Dropping the future unresolved must release a successful child.
    """

    def clone_async(self, handle: Handle, upto: int) -> Future: ...


class RunnerBackend:
    """In-process backend: handles are :class:`Session` objects of one :class:`Runner`."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner

    @property
    def runner(self) -> Runner:
        return self._runner

    @property
    def fingerprint(self) -> str:
        return self._runner.fingerprint

    def clone(self, handle: Session, upto: int) -> Session | None:
        if not handle.valid:  # a dead session (closed, or its runner stopped): no engine call
            return None
        return handle.clone_async(upto).result()

    def clone_async(self, handle: Session, upto: int) -> Future:
        return handle.clone_async(upto)

    def close(self, handle: Session) -> None:
        handle.close()

    def position(self, handle: Session) -> int:
        return handle.position

    def valid(self, handle: Session) -> bool:
        return handle.valid
