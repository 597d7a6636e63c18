"""CloneFuture: ``Session.clone_async``'s ``Future[Session | None]``; :attr:`CloneFuture.refusal` is set
before it resolves None."""

from __future__ import annotations

from concurrent.futures import Future

from engine_service.api.answers import CloneRefusal


class CloneFuture(Future):
    def __init__(self) -> None:
        super().__init__()
        self.refusal: CloneRefusal | None = None

    def refuse(self, reason: CloneRefusal) -> None:
        """Resolve None for ``reason`` (the caller must have claimed the future, or it is pending)."""
        self.refusal = reason
        self.set_result(None)

    @classmethod
    def refused(cls, reason: CloneRefusal) -> CloneFuture:
        future = cls()
        future.refuse(reason)
        return future
