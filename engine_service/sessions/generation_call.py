"""One streamed generation for a caller: updates queued on the engine thread (never waiting), events
(Started, Tokens / Snapshot, Done) yielded on the caller's; a quota with no room left ends it ``length``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.api.answers import CloneRefusal, close_child_when_done, refusal_text
from engine_service.api.config import GenConfig
from engine_service.api.errors import GenerationError
from engine_service.api.logprobs import TokenLogprob
from engine_service.api.stream_events import Done, Event, FinishReason, Snapshot, Started, Tokens
from engine_service.executors.prepared_input import PreparedInput
from engine_service.model.text.detokenizer import StreamDecoder
from engine_service.model.text.token_bytes import token_bytes
from engine_service.runtime.generation import GenerationHandle, GenerationResult, GenerationUpdate
from engine_service.sessions.capture import PendingSnapshot, SnapshotCapture
from engine_service.sessions.handles import HandleRegistry
from engine_service.sessions.inputs import input_size
from engine_service.sessions.reservation import GrowingReservation

if TYPE_CHECKING:
    from engine_service.model.text.tokenizer import Tokenizer
    from engine_service.runtime.session import Session

_POLL_S = 0.25  # how often a waiting stream re-checks that its caller is still there


@dataclass(frozen=True)
class _Update:
    update: GenerationUpdate
    snapshots: tuple[PendingSnapshot, ...] = ()  # due at this update: streamed after its tokens


class GenerationCall:
    """A fresh session is closed at the end unless kept (and finished cleanly), a given one with
    ``close_session``. The caller pinned ``session`` under ``handle`` and reserved what it weighs."""

    def __init__(
        self,
        *,
        registry: HandleRegistry[Session],
        handle: str,
        session: Session,
        fresh: bool,
        keep_session: bool,
        close_session: bool = False,
        tokenizer: Tokenizer,
        input: list[int] | PreparedInput,
        config: GenConfig,
        capture: SnapshotCapture,
        reservation: GrowingReservation,
    ) -> None:
        self._registry = registry
        self._handle = handle
        self._session = session
        self._fresh = fresh
        self._keep = keep_session
        self._close = close_session
        self._tokenizer = tokenizer
        self._input = input
        self._config = config
        self._capture = capture
        self._reservation = reservation
        self._out_of_room = False  # stopped because the owner's quota had no room for the next step
        self._queue: queue.SimpleQueue[_Update] = queue.SimpleQueue()
        self._taken: list[PendingSnapshot] = []  # taken from the queue, not streamed yet
        self._lock = threading.Lock()
        self._closed = False
        self._generation: GenerationHandle | None = None
        self._finished_cleanly = False
        self._unstreamed: str | None = None  # a snapshot handle registered but not yet sent
        self._final: PendingSnapshot | None = None  # the clone at the end (``final_snapshot``), unsent

    # -- engine thread -------------------------------------------------------------------------
    def _on_update(self, update: GenerationUpdate) -> None:
        """Engine thread: queue the snapshots due, grow the reservation or stop, queue the update."""
        stop: GenerationHandle | None = None
        due: tuple[PendingSnapshot, ...] = ()
        with self._lock:  # finish() closes under this lock, then drains: nothing queued is missed
            if not self._closed and update.finish_reason != FinishReason.ERROR:
                due = tuple(self._capture.due(update))
                if update.finished:  # sent after the last tokens, before Done
                    self._final = self._capture.final(update)
            if (
                not self._closed
                and not update.finished
                and not self._out_of_room
                and not self._reservation.room_for_next_step(update.position)
            ):
                self._out_of_room = True
                stop = self._generation  # None until events() has it: it cancels then
            self._queue.put(_Update(update, due))
        if stop is not None:
            stop.cancel()  # handled before the next forward: the session grows no further

    # -- caller's thread -----------------------------------------------------------------------
    def events(self, is_active: Callable[[], bool]) -> Iterator[Event]:
        """Start the generation and yield its events; ends without Done once ``is_active()`` is False."""
        start = self._session.position
        # a pending prediction from the session's last generation is fed first, before the input
        size = input_size(self._input) + (1 if self._session.has_pending else 0)
        generation = self._session.generate_async(self._input, self._config, self._on_update)
        with self._lock:
            self._generation, stop = generation, self._out_of_room
        if stop:
            generation.cancel()
        yield Started(self._handle, start, size)
        text = StreamDecoder(self._tokenizer, skip_special_tokens=True)
        finished = False
        while not finished:
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not is_active():
                    return
                continue
            # Coalesce the updates already queued (a slow client gets fewer, larger messages) up to one
            # with snapshots due: its tokens go first, then the snapshots (each carries its position),
            # so a first token never waits for the prompt snapshot's clone.
            tokens, finished, due = list(item.update.tokens), item.update.finished, item.snapshots
            logprobs = list(item.update.logprobs)
            while not (finished or due) and (nxt := self._poll()) is not None:
                tokens += nxt.update.tokens
                logprobs += nxt.update.logprobs
                finished, due = nxt.update.finished, nxt.snapshots
            self._take(due)
            if tokens:
                yield Tokens(tuple(tokens), text.push_many(tokens), self._spelled(logprobs))
            while (snapshot := self._next_taken()) is not None:
                handle, digest = self._register(snapshot)
                yield _snapshot_event(snapshot, handle, digest)
                self._unstreamed = None  # resumed: gRPC sent the event, the handle is the caller's
        result = generation.wait()
        if result.finish_reason == FinishReason.ERROR:
            error = generation.error
            raise (
                error
                if isinstance(error, Exception)
                else GenerationError(result.error or "generation failed")
            )
        tail = text.flush()
        if tail:
            yield Tokens((), tail)
        with self._lock:
            final, self._final = self._final, None
        if final is not None:
            handle, digest = self._register(final)
            yield _snapshot_event(final, handle, digest)
            self._unstreamed = None
        reason = result.finish_reason
        if reason == FinishReason.CANCELLED and self._out_of_room:
            reason = FinishReason.LENGTH  # stopped at its owner's quota: a complete, truncated answer
        if reason != FinishReason.CANCELLED:
            self._finished_cleanly = True
        yield _done_event(result, reason, start, self._session.position)

    def _poll(self) -> _Update | None:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None

    def _take(self, due: tuple[PendingSnapshot, ...]) -> None:
        with self._lock:
            self._taken.extend(due)
            closed = self._closed
        if closed:  # finish() ran meanwhile: release them as it would have
            _release(self._take_all(), self._registry)

    def _take_all(self) -> list[PendingSnapshot]:
        with self._lock:
            taken, self._taken = self._taken, []
        return taken

    def _next_taken(self) -> PendingSnapshot | None:
        with self._lock:
            return self._taken.pop(0) if self._taken else None

    def _spelled(self, logprobs: list[TokenLogprob]) -> tuple[TokenLogprob, ...]:
        if not logprobs:
            return ()
        spell = token_bytes(self._tokenizer).spell
        return tuple(entry.spelled(spell) for entry in logprobs)

    def _register(self, item: PendingSnapshot) -> tuple[str | None, bytes | None]:
        """Register a snapshot unless the call ended (then release it): (handle, digest)."""
        child = item.future.result()
        if child is None:
            if item.reservation is not None:
                self._registry.discard(item.reservation)
            return None, None
        digest = child.content_digest()
        with self._lock:
            if (
                not self._closed
                and item.reservation is not None
                and self._registry.fill(item.reservation, child)
            ):
                self._unstreamed = item.reservation
                return self._unstreamed, digest
        if item.reservation is not None:
            self._registry.discard(item.reservation)
        child.close()  # the call ended while the clone ran: nobody will ever receive this handle
        return None, None

    def abort(self) -> None:
        generation = self._generation
        if generation is not None and not generation.done():
            generation.cancel()

    def finish(self) -> None:
        """Release what the caller does not own: undelivered clones, a fresh session unless kept, a
        given one with ``close_session``. Idempotent; runs however the stream ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            final, self._final = self._final, None  # taken at the end, the stream gone before it was sent
        self.abort()
        pending = self._take_all()  # clones taken or queued but never streamed
        while (item := self._poll()) is not None:
            pending.extend(item.snapshots)
        _release([*pending, *([final] if final is not None else [])], self._registry)
        self._capture.release()  # snapshots the generation never reached
        unstreamed, self._unstreamed = self._unstreamed, None
        if unstreamed is not None and (child := self._registry.discard(unstreamed)) is not None:
            child.close()  # registered, but the stream ended before the event was sent
        self._registry.unpin(self._handle)
        release = self._close or (self._fresh and not (self._keep and self._finished_cleanly))
        if release and self._registry.discard(self._handle) is not None:
            self._session.close()
        elif not release:
            self._registry.weigh(self._handle, self._session.position)  # held: it weighs what it holds


def _release(snapshots: list[PendingSnapshot], registry: HandleRegistry[Session]) -> None:
    for item in snapshots:
        close_child_when_done(item.future)
        if item.reservation is not None:
            registry.discard(item.reservation)


def _snapshot_event(item: PendingSnapshot, handle: str | None, digest: bytes | None) -> Snapshot:
    if handle:
        return Snapshot(handle, item.position, item.kind, content_digest=digest)
    reason = item.future.refusal or CloneRefusal.BOUNDARY
    text = item.refusal_text or refusal_text(reason, item.position)
    return Snapshot(None, item.position, item.kind, text, reason=reason)


def _done_event(result: GenerationResult, reason: FinishReason, reused: int, position: int) -> Done:
    m = result.metrics
    return Done(
        reason,
        m.prompt_positions,
        reused,
        m.generated_tokens,
        position,
        m.time_to_first_token_s or 0.0,
        m.decode_tokens_per_s,
        m.total_s,
    )
