"""Cloning a held session for its owner or another one: reserved in the payer's quota first, then
made on the engine thread, and released when the caller left in between."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_service.api.answers import CloneRefusal, TakenClone, close_child_when_done
from engine_service.api.errors import Cancelled, Stopping, Unavailable
from engine_service.sessions.handles import HandleRegistry

if TYPE_CHECKING:
    from engine_service.runtime.session import Session

CLONE_TIMEOUT_S = 60.0


def take_clone(
    registry: HandleRegistry[Session],
    source: Session,
    upto: int,
    expected: bytes | None,
    *,
    receiver: str,
    payer: str,
    wanted: Callable[[], bool],
) -> TakenClone:
    """A handle of ``receiver`` for ``[0, upto)`` of ``source`` (only if it holds ``expected`` when
    given), counted against ``payer``; or why not. ``wanted()`` False once made: released, Cancelled."""
    position = source.position
    if upto > position:
        return TakenClone(None, CloneRefusal.POSITION, detail=f"upto={upto} is outside [0, {position}]")
    child_handle = registry.reserve(receiver, upto, payer=payer)  # before the clone is made
    try:
        future = source.clone_async(upto, expected)
        try:
            child = future.result(timeout=CLONE_TIMEOUT_S)
        except TimeoutError:  # concurrent.futures' is the builtin since 3.11
            close_child_when_done(future)  # nobody will receive it
            raise Unavailable(f"the clone did not complete within {CLONE_TIMEOUT_S} s") from None
    except BaseException:
        registry.discard(child_handle)
        raise
    if child is None:
        registry.discard(child_handle)
        return TakenClone(None, future.refusal or CloneRefusal.BOUNDARY)
    if not wanted():
        registry.discard(child_handle)
        child.close()
        raise Cancelled("the caller left before the clone completed")
    # a matched expected digest is the child's: no second hash
    digest = expected if expected is not None else child.content_digest()
    if not registry.fill(child_handle, child):
        child.close()
        raise Stopping("the engine is shutting down")
    return TakenClone(child_handle, content_digest=digest)
