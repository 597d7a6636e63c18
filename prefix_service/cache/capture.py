"""PromptCapture: snapshot a session at its prompt boundary (and prefill breakpoints) while it generates,
then store the snapshots. The clones are queued from the engine thread's callback, so each exists
before decode overwrites the sliding-window rows it needs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any, Protocol

from engine_service.api.answers import close_child_when_done
from engine_service.api.errors import ForklineError
from engine_service.api.stream_events import SnapshotKind, prompt_snapshot_due
from prefix_service.cache.index import token_key
from prefix_service.cache.outcomes import CAPTURE_REFUSED, InsertOutcome
from prefix_service.cache.retention import BOUNDARY_KEY
from prefix_service.cache.session_backend import CaptureBackend, Handle, handle_alive, release_handle

_ACTIVE, _INACTIVE, _COLLECTED, _DISCARDED = "active", "inactive", "collected", "discarded"


class Update(Protocol):
    """What a capture reads of a generation update (the engine's ``GenerationUpdate``)."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def position(self) -> int: ...

    @property
    def breakpoint(self) -> int | None: ...

    @property
    def error(self) -> str | None: ...


class CaptureStore(Protocol):
    """Where a capture stores its snapshots (a :class:`~prefix_service.cache.prefix_cache.PrefixCache`)."""

    def insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        snapshot: Handle,
        metadata: Mapping[str, Any] | None = None,
    ) -> InsertOutcome: ...

    def record_refusal(self, reason: str) -> None: ...


def _release_when_done(backend: CaptureBackend, future: Future) -> None:
    """Close the future's handle once it settles (now, if it already has)."""
    close_child_when_done(future, lambda handle: release_handle(backend, handle))


class PromptCapture:
    """Made by :meth:`PrefixCache.capture_prompt`: ``session.generate_async(suffix, config,
    capture.wrap(callback))``, then ``capture.collect(namespace)`` on the caller's thread. A capture of
    a closed session forwards updates and clones nothing."""

    def __init__(
        self, cache: CaptureStore, backend: CaptureBackend, session: Handle, prompt: Sequence[int]
    ) -> None:
        self._cache = cache
        self._backend = backend
        self._session = session  # held: the capture keeps the original session's identity
        self._prompt = token_key(prompt, "prompt")  # a copy: later mutation by the caller is harmless
        self._lock = threading.Lock()  # callbacks run on the engine thread, collect on the caller's
        self._pending: dict[int, tuple[Future, str]] = {}  # position -> (clone future, boundary)
        self._prompt_requested = False
        alive = bool(self._prompt) and handle_alive(self._backend, session)
        self._state = _ACTIVE if alive else _INACTIVE

    @property
    def prompt(self) -> tuple[int, ...]:
        return self._prompt

    @property
    def active(self) -> bool:
        return self._state == _ACTIVE

    @property
    def requested(self) -> tuple[int, ...]:
        """Positions a clone has been queued at, ascending."""
        with self._lock:
            return tuple(sorted(self._pending))

    def wrap(self, callback: Callable[[Update], None] | None) -> Callable[[Update], None]:
        """``callback`` (may be None; its exception fails the generation) behind the capture: a clone
        at each prefill breakpoint, and at the prompt end once ``prompt_snapshot_due``."""

        def wrapped(update: Update) -> None:
            self._on_breakpoint(update)
            if not self._prompt_requested and prompt_snapshot_due(
                update.tokens, update.position, len(self._prompt), update.error
            ):
                self._prompt_requested = True
                self._request(len(self._prompt), SnapshotKind.PROMPT)
            if callback is not None:
                callback(update)

        return wrapped

    @property
    def observer(self) -> Callable[[Update], None]:  # the breakpoint clones only
        return self._on_breakpoint

    def collect(
        self, namespace: str, metadata: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> int:
        """Wait for the queued clones and insert them (checkpoints ``boundary="breakpoint"``); how many
        were stored (a refusal is counted; a second collect: 0). Never from a generation callback."""
        with self._lock:
            if self._state != _ACTIVE:
                return 0
            self._state = _COLLECTED
            pending = sorted(self._pending.items())
            self._pending.clear()
        stored = 0
        for position, (future, boundary) in pending:
            try:
                handle = future.result(timeout)
            except TimeoutError:
                _release_when_done(self._backend, future)
                handle = None
            except (CancelledError, ForklineError):
                handle = None
            if handle is None:
                self._cache.record_refusal(CAPTURE_REFUSED)
                continue
            tags = dict(metadata or {})
            if boundary == SnapshotKind.BREAKPOINT:
                tags[BOUNDARY_KEY] = SnapshotKind.BREAKPOINT
            else:
                tags.setdefault(BOUNDARY_KEY, SnapshotKind.PROMPT)
            if self._cache.insert(namespace, self._prompt[:position], handle, tags).stored:
                stored += 1
        return stored

    def discard(self) -> None:
        """Release every clone this capture queued; later updates are only forwarded."""
        with self._lock:
            if self._state in (_COLLECTED, _DISCARDED):
                return
            self._state = _DISCARDED
            pending = list(self._pending.values())
            self._pending.clear()
        for future, _ in pending:
            _release_when_done(self._backend, future)

    # -- engine-thread side ------------------------------------------------------------------

    def _on_breakpoint(self, update: Update) -> None:
        position = update.breakpoint
        if position is not None:
            self._request(position, SnapshotKind.BREAKPOINT)

    def _request(self, position: int, boundary: str) -> None:
        """Queue one clone at ``position`` (never waits: this runs on the engine thread)."""
        with self._lock:
            if self._state != _ACTIVE or position in self._pending:
                return
            if not 1 <= position <= len(self._prompt):
                return
            if not handle_alive(self._backend, self._session):
                return  # a closed source forwards outputs without retaining a session
            try:
                future = self._backend.clone_async(self._session, position)
            except ForklineError:
                future = Future()
                future.set_result(None)
            self._pending[position] = (future, boundary)
