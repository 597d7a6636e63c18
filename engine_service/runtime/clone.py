"""CloneFuture: what ``Session.clone_async`` returns, a ``Future[Session | None]`` whose
:attr:`CloneFuture.refusal` (an ``api.clones.CloneRefusal``) says why it resolved None. The engine sets
the reason before it resolves the future, so it is readable once ``result()`` returns.
"""

from __future__ import annotations

from concurrent.futures import Future

from engine_service.api.answers import CloneRefusal


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
