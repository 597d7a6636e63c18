"""Typed commands other threads queue for the engine thread, and the table that routes them.

Every interaction with sessions from outside the engine thread is one of these dataclasses, put on
the runner's inbox and handled in FIFO order between two forward passes. ``CommandTable.dispatch``
routes a command to the handler registered for its exact type; an unknown type raises TypeError.

Each command also knows how to settle its caller when the engine does not run it to the end, so the
engine loop never asks which kind of command it holds:

- :meth:`Command.fail`: its handler raised an Exception; the engine carries on.
- :meth:`Command.abandon`: the engine thread dies of a BaseException (SystemExit...) while handling it.
- :meth:`Command.settle_unrun`: it was still queued when the engine stopped; no executor call is made
  for it (a close still releases its session, a barrier still passes).

What settling needs from the engine loop comes in as :class:`EngineHooks`; this module never imports
the loop.
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
    """What settling a command needs from the engine loop.

    finish: ends a generation once (``finish(gen, reason, error)``): frees its session, sends its
        terminal update and settles its handle; a no-op for a generation that already ended.
    run: handles a command as the running engine would (the command table's dispatch).
    counts: the engine's counters (see ``RunnerMetrics``).
    """

    finish: Callable[[ActiveGeneration, str, BaseException | None], None]
    run: Callable[[Command], None]
    counts: dict[str, int]


def _stopped(exc: BaseException) -> str:
    return f"engine thread stopped: {type(exc).__name__}"


class Command:
    """Base of every command: how it settles its caller when the engine does not run it to the end.

    The defaults settle :meth:`caller` (the future waiting on this command, if any).
    """

    def caller(self) -> Future | None:
        """The future the caller waits on, or None (no future, or the caller dropped it)."""
        return None

    def fail(self, exc: Exception, hooks: EngineHooks) -> None:
        """The handler raised ``exc`` and the engine carries on: the caller's future gets ``exc``."""
        future = self.caller()
        if future is not None and not future.done():
            future.set_exception(exc)

    def abandon(self, exc: BaseException, hooks: EngineHooks) -> None:
        """The engine thread dies of ``exc`` while handling this: settle the caller before it does
        (teardown settles only what is still queued or active). A waiting future resolves None."""
        future = self.caller()
        if future is not None and not future.done():
            future.set_result(None)

    def settle_unrun(self, hooks: EngineHooks) -> None:
        """Queued when the engine stopped: settle the caller without calling the executor for it."""


@dataclass(frozen=True)
class OpenCommand(Command):
    """Open an empty session; the future gets the Session or a ResourceExhausted/Unavailable."""

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
    """Clone session ``key`` at ``[0, upto)``; with ``expected_digest``, only when ``[0, upto)``
    holds exactly that content (checked by the engine thread when it runs the clone).

    The runner holds the caller's :class:`CloneFuture` only weakly: a future the caller dropped before
    the command runs is dead, and the engine skips the clone (nobody could ever release the child). An
    abandoned or unrun clone is refused (``CloneRefusal.STOPPING``): its future resolves None.
    """

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
    """Close session ``key``: cancel its generation, release it in the executor. Idempotent.

    Runs even when the engine stops with it queued: releasing a session is what shutdown does anyway.
    """

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
    """Cancel ``generation`` (the engine reaps it before the next forward).

    A failed cancel ends the generation with the error; an unrun one has nothing to do (teardown
    already ended every live generation)."""

    generation: ActiveGeneration

    def fail(self, exc: Exception, hooks: EngineHooks) -> None:
        hooks.finish(self.generation, FinishReason.ERROR, GenerationError(f"{type(exc).__name__}: {exc}"))


@dataclass(frozen=True)
class BarrierCommand(Command):
    """Resolves its future once every command queued before it has run (also wakes the engine).

    It passes when the engine stops too, so nobody waits on it forever."""

    future: Future | None = None

    def caller(self) -> Future | None:
        return self.future

    def resolve(self) -> None:
        """Its handler: let the waiter through (unless it cancelled)."""
        if self.future is not None and self.future.set_running_or_notify_cancel():
            self.future.set_result(None)

    def settle_unrun(self, hooks: EngineHooks) -> None:
        self.resolve()


class CommandTable:
    """Routes each command to the handler registered for its exact type."""

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
