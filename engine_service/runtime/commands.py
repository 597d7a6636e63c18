"""Typed commands other threads queue for the engine thread, and the table that routes them.

Every interaction with sessions from outside the engine thread is one of these dataclasses, put on
the runner's inbox and handled in FIFO order between two forward passes. ``CommandTable.dispatch``
routes a command to the handler registered for its exact type; an unknown type raises TypeError.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_service.runtime.state import ActiveGeneration


@dataclass(frozen=True)
class OpenCommand:
    """Open an empty session; the future gets the Session or a ResourceExhausted/Unavailable."""

    future: Future


@dataclass(frozen=True)
class CloneCommand:
    """Clone session ``key`` at ``[0, upto)``.

    The runner holds the caller's future only weakly: a future the caller dropped before the command
    runs is dead, and the engine skips the clone (nobody could ever release the child).
    """

    key: int
    upto: int
    future_ref: weakref.ref


@dataclass(frozen=True)
class CloseCommand:
    """Close session ``key``: cancel its generation, release it in the executor. Idempotent."""

    key: int


@dataclass(frozen=True)
class StartCommand:
    """Start ``generation`` on session ``key``."""

    key: int
    generation: ActiveGeneration


@dataclass(frozen=True)
class CancelCommand:
    """Cancel ``generation`` (the engine reaps it before the next forward)."""

    generation: ActiveGeneration


@dataclass(frozen=True)
class BarrierCommand:
    """Resolves its future once every command queued before it has run (also wakes the engine)."""

    future: Future | None = None


Command = OpenCommand | CloneCommand | CloseCommand | StartCommand | CancelCommand | BarrierCommand


class CommandTable:
    """Routes each command to the handler registered for its exact type."""

    def __init__(self, handlers: dict[type, Callable[[Any], None]]) -> None:
        self._handlers = dict(handlers)

    def handles(self, command: object) -> bool:
        return type(command) in self._handlers

    def dispatch(self, command: object) -> None:
        handler = self._handlers.get(type(command))
        if handler is None:
            raise TypeError(f"unknown command {type(command).__name__}; known: "
                            f"{', '.join(sorted(t.__name__ for t in self._handlers))}")
        handler(command)
