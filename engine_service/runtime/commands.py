"""Typed commands other threads queue for the engine thread (handled in FIFO order between two
forwards), the table that routes them by exact type, and how each settles its caller when the engine
does not run it to the end (handler raised, engine thread died, still queued at stop).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_service.api.answers import CloneRefusal
from engine_service.api.errors import GenerationError, Stopping
from engine_service.api.stream_events import FinishReason
from engine_service.runtime.clone import CloneFuture

if TYPE_CHECKING:
    from engine_service.runtime.state import ActiveGeneration


@dataclass(frozen=True)
class EngineHooks:
    """What settling a command needs from the engine loop: ``finish(gen, reason, error)`` ends a
    generation once, ``run`` dispatches a command, ``counts`` are the engine's counters."""

    finish: Callable[[ActiveGeneration, str, BaseException | None], None]
    run: Callable[[Command], None]
    counts: dict[str, int]


def _stopped(exc: BaseException) -> str:
    return f"engine thread stopped: {type(exc).__name__}"


class Command:
    """Base of every command; the defaults settle :meth:`caller`, the future waiting on it."""

    def caller(self) -> Future | None:
        return None

    def fail(self, exc: Exception, hooks: EngineHooks) -> None:
        """The handler raised ``exc`` and the engine carries on: the caller's future gets ``exc``."""
        future = self.caller()
        if future is not None and not future.done():
            future.set_exception(exc)

    def abandon(self, exc: BaseException, hooks: EngineHooks) -> None:
        """The engine thread dies of ``exc`` while handling this: settle the caller first."""
        future = self.caller()
        if future is not None and not future.done():
            future.set_result(None)

    def settle_unrun(self, hooks: EngineHooks) -> None:
        """Queued when the engine stopped: settle the caller without calling the executor for it."""


@dataclass(frozen=True)
class OpenCommand(Command):
    future: Future

    def caller(self) -> Future:
        return self.future

    def abandon(self, exc: BaseException, hooks: EngineHooks) -> None:
        if not self.future.done():
            self.future.set_exception(Stopping(_stopped(exc)))

    def settle_unrun(self, hooks: EngineHooks) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(Stopping("runner is stopping"))


@dataclass(frozen=True)
class CloneCommand(Command):
    """Clone session ``key`` at ``[0, upto)`` (only when it holds ``expected_digest``, if given). The
    future is held weakly: one the caller dropped skips the clone (nobody could release the child)."""

    key: int
    upto: int
    future_ref: weakref.ref
    expected_digest: bytes | None = None

    def caller(self) -> CloneFuture | None:
        return self.future_ref()

    def abandon(self, exc: BaseException, hooks: EngineHooks) -> None:
        future = self.future_ref()
        if future is not None and not future.done():
            future.refuse(CloneRefusal.STOPPING)

    def settle_unrun(self, hooks: EngineHooks) -> None:
        future = self.future_ref()
        if future is not None and future.set_running_or_notify_cancel():
            hooks.counts["clones_refused"] += 1
            future.refuse(CloneRefusal.STOPPING)


@dataclass(frozen=True)
class CloseCommand(Command):
    """Close session ``key``: cancel its generation, release it in the executor. Idempotent; runs
    even when the engine stops with it queued."""

    key: int

    def settle_unrun(self, hooks: EngineHooks) -> None:
        hooks.run(self)


@dataclass(frozen=True)
class StartCommand(Command):
    """Start ``generation`` on session ``key``. Settling it ends the generation: with an error when
    its handler failed or the engine died, as cancelled when the engine stopped before running it."""

    key: int
    generation: ActiveGeneration

    def fail(self, exc: Exception, hooks: EngineHooks) -> None:
        hooks.finish(self.generation, FinishReason.ERROR, GenerationError(f"{type(exc).__name__}: {exc}"))

    def abandon(self, exc: BaseException, hooks: EngineHooks) -> None:
        hooks.finish(self.generation, FinishReason.ERROR, GenerationError(_stopped(exc)))

    def settle_unrun(self, hooks: EngineHooks) -> None:
        hooks.finish(self.generation, FinishReason.CANCELLED, None)


@dataclass(frozen=True)
class CancelCommand(Command):
    """Cancel ``generation`` (the engine reaps it before the next forward)."""

    generation: ActiveGeneration

    def fail(self, exc: Exception, hooks: EngineHooks) -> None:
        hooks.finish(self.generation, FinishReason.ERROR, GenerationError(f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True)
class BarrierCommand(Command):
    """Resolves its future once every command queued before it has run, or the engine stopped."""

    future: Future | None = None

    def caller(self) -> Future | None:
        return self.future

    def resolve(self) -> None:
        if self.future is not None and self.future.set_running_or_notify_cancel():
            self.future.set_result(None)

    def settle_unrun(self, hooks: EngineHooks) -> None:
        self.resolve()


class CommandTable:
    def __init__(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        self._handlers = dict(handlers)

    def handles(self, command: object) -> bool:
        return type(command) in self._handlers

    def dispatch(self, command: object) -> None:
        handler = self._handlers.get(type(command))
        if handler is None:
            raise TypeError(
                f"unknown command {type(command).__name__}; known: "
                f"{', '.join(sorted(t.__name__ for t in self._handlers))}"
            )
        handler(command)
