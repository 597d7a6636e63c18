"""A fake SessionBackend for prefix-cache tests: sessions are token lists with a retention floor.

A FakeSession holds its committed tokens: its content, as an engine records it (``PREPARED`` for a
position fed by a prepared input). ``content_digest`` answers from that content, so a snapshot whose
tokens differ from the key it is inserted under is caught exactly as the engine would catch it (the
fake never just says "matches"). ``floor`` models a sliding-window cache: positions below it
can no longer be cloned (decode has overwritten the rows), and a clone inherits its donor's floor.
The backend counts every clone call and close, tracks live sessions (leak checks), can run out of
capacity, fail the next clones, or die (every handle becomes invalid; no clone call is made).
``clone_async`` either settles at once or, with ``deferred``, queues (as does ``close``) until
``run_pending()`` runs the queue in FIFO order, like the runner's command inbox.

FakeEngine and WindowBackend (the engine-side fakes): ``tests/unit/prefix/fake_engine.py``.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from dataclasses import dataclass

from engine_service.api.content import PREPARED, content_digest
from engine_service.api.errors import ResourceExhausted


@dataclass(frozen=True)
class FakeUpdate:
    """Shape of engine_service.runtime.session.GenerationUpdate that the capture reads."""

    tokens: tuple[int, ...] = ()
    position: int = 0
    breakpoint: int | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


class FakeSession:
    _ids = itertools.count(1)

    def __init__(self, backend: FakeBackend, tokens: tuple[int, ...], floor: int = 0) -> None:
        self.backend = backend
        self.id = next(self._ids)
        self.tokens = tuple(tokens)
        self.floor = floor
        self.closed = False
        self.close_calls = 0

    @property
    def position(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: tuple[int, ...], window: int | None = None) -> None:
        """Commit more tokens; with ``window``, rows older than ``position - window`` are lost."""
        self.tokens += tuple(tokens)
        if window is not None:
            self.floor = max(self.floor, self.position - window)

    def __repr__(self) -> str:
        return f"FakeSession#{self.id}(pos={self.position}, closed={self.closed})"


def digest_of(tokens: tuple[int, ...]) -> bytes | None:
    """What an engine reports a session holding ``tokens`` holds (None: a prepared input in range)."""
    return None if PREPARED in tokens else content_digest(tokens)


class FakeBackend:
    def __init__(self, fingerprint: str = "fake-model", capacity: int = 1_000_000, deferred: bool = False):
        self.fingerprint = fingerprint
        self.capacity = capacity  # most live sessions at once
        self.deferred = deferred
        self.dead = False
        self.fail_next = 0  # clones that raise ResourceExhausted (an allocation failure)
        self.clone_calls: list[tuple[int, int]] = []  # (source id, upto)
        self.digest_calls = 0  # content_digest calls (the cache asks once per insert)
        self.live: set[FakeSession] = set()
        self._queue: list[tuple[Future | None, FakeSession, int]] = []  # (None, s, 0) is a close

    # -- helpers for tests -------------------------------------------------------------------

    def open(self, tokens: tuple[int, ...] | list[int], floor: int = 0) -> FakeSession:
        session = FakeSession(self, tuple(tokens), floor)
        self.live.add(session)
        return session

    def run_pending(self) -> None:
        queue, self._queue = self._queue, []
        for future, source, upto in queue:
            if future is None:
                self._do_close(source)
            elif not future.cancelled():
                future.set_result(self._do_clone(source, upto))

    # -- SessionBackend ----------------------------------------------------------------------

    def clone(self, handle: FakeSession, upto: int) -> FakeSession | None:
        if self.fail_next > 0:
            self.fail_next -= 1
            self.clone_calls.append((handle.id, upto))
            raise ResourceExhausted("fake allocation failure")
        return self._do_clone(handle, upto)

    def clone_async(self, handle: FakeSession, upto: int) -> Future:
        future: Future = Future()
        if self.fail_next > 0:  # the engine turns a clone exception into a refusal
            self.fail_next -= 1
            self.clone_calls.append((handle.id, upto))
            future.set_result(None)
        elif self.deferred:
            self._queue.append((future, handle, upto))
        else:
            future.set_result(self._do_clone(handle, upto))
        return future

    def close(self, handle: FakeSession) -> None:
        if self.deferred:
            self._queue.append((None, handle, 0))
        else:
            self._do_close(handle)

    def position(self, handle: FakeSession) -> int:
        return handle.position

    def valid(self, handle: FakeSession) -> bool:
        return not handle.closed and not self.dead and handle.backend is self

    def content_digest(self, handle: FakeSession) -> bytes | None:
        self.digest_calls += 1
        return digest_of(handle.tokens)

    # -- internals ---------------------------------------------------------------------------

    def _do_close(self, handle: FakeSession) -> None:
        handle.close_calls += 1
        handle.closed = True
        self.live.discard(handle)

    def _do_clone(self, source: FakeSession, upto: int) -> FakeSession | None:
        self.clone_calls.append((source.id, upto))
        if not self.valid(source) or not 0 <= upto <= source.position or upto < source.floor:
            return None
        if len(self.live) >= self.capacity:
            return None
        return self.open(source.tokens[:upto], floor=min(source.floor, upto))


def fake_generate(
    backend: FakeBackend,
    session: FakeSession,
    prompt: tuple[int, ...],
    callback,
    new_tokens: tuple[int, ...] = (500, 501, 502),
    window: int | None = None,
    breakpoints: tuple[int, ...] = (),
) -> None:
    """Drive ``callback`` like the runner would for ``prompt`` on ``session`` (which holds a prefix of
    it): prefill stops at each breakpoint and emits a breakpoint update; the first prediction comes
    with the prompt committed; each decode step commits the previous prediction. Queued commands run
    between forwards (``run_pending``), i.e. before decode overwrites sliding-window rows."""
    for point in sorted(breakpoints):
        if session.position < point < len(prompt):
            session.extend(prompt[session.position : point], window)
            callback(FakeUpdate(position=point, breakpoint=point))
            backend.run_pending()
    session.extend(prompt[session.position :], window)
    callback(FakeUpdate(tokens=new_tokens[:1], position=session.position))
    backend.run_pending()
    for previous, token in zip(new_tokens, new_tokens[1:], strict=False):
        if session.closed:
            callback(FakeUpdate(position=session.position, finished=True, finish_reason="cancelled"))
            return
        session.extend((previous,), window)
        callback(FakeUpdate(tokens=(token,), position=session.position))
        backend.run_pending()
    callback(FakeUpdate(position=session.position, finished=True, finish_reason="length"))
    backend.run_pending()
