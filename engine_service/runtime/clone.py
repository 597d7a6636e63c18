"""Why a clone was refused: :class:`CloneRefusal`, carried by the :class:`CloneFuture` a clone returns.

``Session.clone_async`` returns a ``CloneFuture``: a ``Future[Session | None]`` like any other (callers
that only need the child keep working), whose :attr:`CloneFuture.refusal` says why it resolved None.
The engine sets the reason before it resolves the future, so it is readable once ``result()`` returns.
"""

from __future__ import annotations

from concurrent.futures import Future
from enum import StrEnum


class CloneRefusal(StrEnum):
    """Why a clone produced no session (the values are the wire names, lower case)."""

    POSITION = "position"  # upto is outside [0, committed position] when the engine runs the clone
    BOUNDARY = "boundary"  # the executor refused: no free slot, no room, or it raised
    WINDOW = "window"  # upto is below the source's ring floor (sliding window): the rows are gone
    CONTENT_MISMATCH = "content_mismatch"  # [0, upto) does not hold the expected content
    PREPARED_INPUT = "prepared_input"  # an expected digest was given and [0, upto) holds a prepared input
    SOURCE_UNUSABLE = "source_unusable"  # the source is closed or failed
    STOPPING = "stopping"  # the runner is stopping
    QUOTA = "quota"  # the snapshot's owner has no room left in its quota (decided by the rpc layer)


class CloneFuture(Future):
    """A clone's future: the child Session, or None with :attr:`refusal` set."""

    def __init__(self) -> None:
        super().__init__()
        self.refusal: CloneRefusal | None = None

    def refuse(self, reason: CloneRefusal) -> None:
        """Resolve None for ``reason`` (the caller must have claimed the future, or it is pending)."""
        self.refusal = reason
        self.set_result(None)

    @classmethod
    def refused(cls, reason: CloneRefusal) -> CloneFuture:
        """An already refused clone."""
        future = cls()
        future.refuse(reason)
        return future
