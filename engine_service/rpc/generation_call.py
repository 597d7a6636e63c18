"""One streamed Generate call: a generation on a session, its capture clones, and its cleanup.

The runner delivers updates on the engine thread; :meth:`GenerationCall.events` runs on the gRPC
thread and turns them into events. The engine-thread callback only puts items on a queue and, for
capture options, *queues* a clone (``clone_async``) before the next forward: it never waits. The gRPC
thread waits for clone futures, registers the snapshot handles for the caller and detokenizes.

Ownership: a session this call opened is registered to the caller for the duration of the call and
closed at the end unless ``keep_session`` (a cancelled or failed call closes it regardless). Snapshot
handles that were streamed belong to the caller, or to ``snapshot_owner`` (a persistent owner the
caller hands them to). When the call ends early (client cancel or disconnect, server drain),
:meth:`abort` cancels the generation and releases every clone the caller never received.

Quotas: :meth:`GenerationCall.reserve_snapshots` reserves every snapshot in its owner's quota before
the generation starts (a snapshot for the caller that does not fit fails the call; one handed to
another owner that does not fit is refused with ``CloneRefusal.QUOTA`` when its time comes, and the
generation goes on). The session's weight returns to its position when the call ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.api.clones import CloneRefusal, refusal_text
from engine_service.api.config import GenConfig
from engine_service.api.errors import GenerationError, ResourceExhausted
from engine_service.api.stream_events import (
    Done,
    Event,
    FinishReason,
    Snapshot,
    SnapshotKind,
    Started,
    Tokens,
)
from engine_service.executors.prepared_input import PreparedInput
from engine_service.handles import HandleRegistry
from engine_service.model.detokenizer import StreamDecoder
from engine_service.rpc import convert
from engine_service.runtime.clone import CloneFuture
from engine_service.runtime.generation import GenerationHandle, GenerationResult, GenerationUpdate
from engine_service.runtime.session import close_child_when_done

if TYPE_CHECKING:
    from engine_service.model.tokenizer import Tokenizer
    from engine_service.runtime.session import Session

_POLL_S = 0.25  # how often a waiting stream re-checks that its client is still there


@dataclass(frozen=True)
class _Snapshot:
    future: CloneFuture
    position: int
    kind: str
    reservation: str | None = None  # the handle reserved for the child
    refusal_text: str = ""  # why it was refused before any clone (the quota)


@dataclass(frozen=True)
class _Update:
    update: GenerationUpdate


class GenerationCall:
    """See the module docstring. ``session`` is resolved (and pinned under ``handle``) by the caller."""

    def __init__(
        self,
        *,
        registry: HandleRegistry[Session],
        owner: str,
        handle: str,
        session: Session,
        fresh: bool,
        keep_session: bool,
        tokenizer: Tokenizer,
        prompt_snapshot: bool,
        breakpoints: tuple[int, ...],
        snapshot_owner: str | None = None,
    ) -> None:
        self._registry = registry
        self._owner = owner
        self._handle = handle
        self._session = session
        self._fresh = fresh
        self._keep = keep_session
        self._tokenizer = tokenizer
        self._prompt_snapshot = prompt_snapshot
        self._breakpoints = frozenset(breakpoints)
        self._queue: queue.SimpleQueue[_Snapshot | _Update] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._captured_prompt = False
        self._prompt_end = 0
        self._generation: GenerationHandle | None = None
        self._finished_cleanly = False
        self._unstreamed: str | None = None  # a snapshot handle registered but not yet sent
        self._snapshot_owner = snapshot_owner or owner
        # (kind, position) -> the handle reserved for that snapshot, or why it has no room
        self._reserved: dict[tuple[str, int], str | ResourceExhausted] = {}

    def reserve_snapshots(self, prompt_end: int) -> None:
        """Reserve every snapshot this call may take in its owner's quota (before the generation
        starts; see the module docstring). The caller releases them (:meth:`release_reservations`)
        when the call does not start."""
        wanted = [(SnapshotKind.BREAKPOINT, p) for p in sorted(self._breakpoints)]
        if self._prompt_snapshot:
            wanted.append((SnapshotKind.PROMPT, prompt_end))
        for kind, position in wanted:
            try:
                self._reserved[(kind, position)] = self._registry.reserve(self._snapshot_owner, position)
            except ResourceExhausted as exc:
                if self._snapshot_owner == self._owner:
                    raise
                self._reserved[(kind, position)] = exc

    def release_reservations(self) -> None:
        """Give back the snapshot reservations nothing used."""
        with self._lock:
            left, self._reserved = list(self._reserved.values()), {}
        for reservation in left:
            if isinstance(reservation, str):
                self._registry.discard(reservation)

    def _clone(self, kind: str, position: int) -> _Snapshot:
        """Queue the snapshot clone (engine thread, lock held) into its reservation, or its refusal."""
        reservation = self._reserved.pop((kind, position), None)
        if isinstance(reservation, ResourceExhausted):
            return _Snapshot(CloneFuture.refused(CloneRefusal.QUOTA), position, kind, None, str(reservation))
        return _Snapshot(self._session.clone_async(position), position, kind, reservation)

    # -- engine thread -------------------------------------------------------------------------
    def _on_update(self, update: GenerationUpdate) -> None:
        """Runner callback (engine thread): queue clones for captures, then hand the update over."""
        with self._lock:
            # the terminal update may carry the only tokens (max_new_tokens 1): capture there too
            if not self._closed and update.finish_reason != FinishReason.ERROR:
                if update.breakpoint is not None and update.breakpoint in self._breakpoints:
                    self._queue.put(self._clone(SnapshotKind.BREAKPOINT, update.breakpoint))
                if (
                    self._prompt_snapshot
                    and not self._captured_prompt
                    and (update.tokens or update.position >= self._prompt_end)
                ):
                    self._captured_prompt = True
                    self._queue.put(self._clone(SnapshotKind.PROMPT, self._prompt_end))
        self._queue.put(_Update(update))

    # -- gRPC thread ---------------------------------------------------------------------------
    def events(
        self, input: list[int] | PreparedInput, config: GenConfig, is_active: Callable[[], bool]
    ) -> Iterator[Event]:
        """Start the generation and yield its stream events until done. ``is_active()`` is False once
        the client has gone; the generation is then cancelled and the loop ends without done."""
        start = self._session.position
        # a pending prediction from the session's last generation is fed first, before the input
        size = convert.input_size(input) + (1 if self._session.has_pending else 0)
        self._prompt_end = start + size
        generation = self._generation = self._session.generate_async(input, config, self._on_update)
        yield Started(self._handle, start, size)
        text = StreamDecoder(self._tokenizer, skip_special_tokens=True)
        held: _Snapshot | None = None  # a snapshot taken while coalescing, handled next
        item: _Snapshot | _Update
        while True:
            if held is not None:
                item, held = held, None
            else:
                try:
                    item = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if not is_active():
                        return
                    continue
            if isinstance(item, _Snapshot):
                handle, digest = self._register(item)
                yield _snapshot_event(item, handle, digest)
                self._unstreamed = None  # resumed: gRPC sent the event, the handle is the caller's
                continue
            # Coalesce the updates already queued (a slow client gets fewer, larger messages); stop at
            # a snapshot so events keep the engine's order.
            tokens, finished = list(item.update.tokens), item.update.finished
            while not finished:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(nxt, _Snapshot):
                    held = nxt
                    break
                tokens += nxt.update.tokens
                finished = nxt.update.finished
            if tokens:
                yield Tokens(tuple(tokens), text.push_many(tokens))
            if finished:
                break
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
        if result.finish_reason != FinishReason.CANCELLED:
            self._finished_cleanly = True
        yield _done_event(result, start, self._session.position)

    def _register(self, item: _Snapshot) -> tuple[str | None, bytes | None]:
        """Register a snapshot for its owner in its reservation, unless the call already ended (then
        release it); its handle and content digest (the child is idle and nobody else holds it yet:
        safe to read)."""
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
        """Cancel the generation (if running); called when the RPC ends for any reason."""
        generation = self._generation
        if generation is not None and not generation.done():
            generation.cancel()

    def finish(self) -> None:
        """Release what the caller does not own: undelivered clones (queued, or registered but never
        sent), and a fresh session unless kept.

        Idempotent; runs when the stream ends, however it ends.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.abort()
        while True:  # clones queued but never streamed
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Snapshot):
                close_child_when_done(item.future)
                if item.reservation is not None:
                    self._registry.discard(item.reservation)
        self.release_reservations()  # snapshots the generation never reached
        unstreamed, self._unstreamed = self._unstreamed, None
        if unstreamed is not None and (child := self._registry.discard(unstreamed)) is not None:
            child.close()  # registered, but the stream ended before the event was sent
        self._registry.unpin(self._handle)
        release = self._fresh and not (self._keep and self._finished_cleanly)
        if release and self._registry.discard(self._handle) is not None:
            self._session.close()
        elif not release:
            self._registry.weigh(self._handle, self._session.position)  # held: it weighs what it holds


def _snapshot_event(item: _Snapshot, handle: str | None, digest: bytes | None) -> Snapshot:
    """The event of a snapshot: its handle holding ``[0, position)`` with ``digest``, or why not."""
    if handle:
        return Snapshot(handle, item.position, item.kind, content_digest=digest)
    reason = item.future.refusal or CloneRefusal.BOUNDARY
    text = item.refusal_text or refusal_text(reason, item.position)
    return Snapshot(None, item.position, item.kind, text, reason=reason)


def _done_event(result: GenerationResult, reused: int, position: int) -> Done:
    m = result.metrics
    return Done(
        result.finish_reason,
        m.prompt_positions,
        reused,
        m.generated_tokens,
        position,
        m.time_to_first_token_s or 0.0,
        m.decode_tokens_per_s,
        m.total_s,
    )
