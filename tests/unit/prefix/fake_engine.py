"""The fake engine of the prefix unit tests: :class:`FakeEngine` (a GatewayBackend with a scripted
Generate stream, :class:`FakeStream`) and :class:`WindowBackend` (a FakeBackend whose refusals say why).
FakeEngine follows the real backend: ``tests/service/test_fake_engine_conformance.py``.
"""

from __future__ import annotations

import threading
from dataclasses import replace

from engine_service.api.answers import CloneRefusal, Described, TakenClone
from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo, WindowGeometry
from engine_service.api.errors import Cancelled, InvalidArgument, NotFound, QuotaExceeded
from engine_service.api.prompts import TextPrompt, Tokenized
from engine_service.api.stream_events import Done, Snapshot, SnapshotKind, Started, Tokens
from prefix_service.gateway.gateway_backend import EngineGenerate
from tests.unit.prefix.fakes import FakeBackend, FakeSession, digest_of


class WindowBackend(FakeBackend):
    """A FakeBackend whose refusals say why (``CloneRefusal.WINDOW`` below the source's floor) and
    that publishes ``max_rewind`` (None: the cache tries every candidate, as on batched-cell). Use
    :meth:`snapshot` for a snapshot as an engine's ring leaves it: floor ``n - max_write``."""

    def __init__(self, max_write: int = 64, max_rewind: int | None = 64, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_write = max_write
        self.max_rewind = max_rewind

    def snapshot(self, tokens: tuple[int, ...] | list[int]) -> FakeSession:
        return self.open(tokens, floor=max(0, len(tokens) - self.max_write))

    def clone_or_refusal(self, handle: FakeSession, upto: int) -> TakenClone:
        child = self.clone(handle, upto)
        if child is not None:
            return TakenClone(child)
        below = self.valid(handle) and 0 <= upto <= handle.position and upto < handle.floor
        return TakenClone(None, CloneRefusal.WINDOW if below else CloneRefusal.BOUNDARY)


def done_event(prompt_positions: int, reused: int) -> Done:
    return Done("length", prompt_positions, reused, 1, reused + prompt_positions, 0.5, 10.0, 1.0)


class FakeStream:
    """A scripted engine Generate stream: ``events`` in order; after ``cancel()`` it raises Cancelled,
    as a cancelled gRPC call does. With ``hang_after`` it hangs (until cancelled) after that many
    events, like an engine stream that does not end. ``on_end()`` runs once when the call ends (its
    last event read, or cancelled), as the engine's cleanup does. :meth:`session_closed`: the engine
    ends the generation (a Done ``cancelled`` next), as a Close of its session does."""

    def __init__(self, events: list, hang_after: int | None = None, on_end=lambda: None) -> None:
        self.events = list(events)
        self.hang_after = hang_after
        self.sent = 0
        self.cancelled = threading.Event()
        self._woken = threading.Event()  # cancelled, or the session closed: a hang ends
        self._on_end = on_end

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self):
        if self.hang_after is not None and self.sent >= self.hang_after:
            self._woken.wait(10)
        if self.cancelled.is_set():
            self._end()
            raise Cancelled("the engine call was cancelled")
        if not self.events:
            self._end()
            raise StopIteration
        self.sent += 1
        return self.events.pop(0)

    def cancel(self) -> None:
        self.cancelled.set()
        self._woken.set()
        self._end()

    def session_closed(self) -> None:
        """What the engine sent stays; its Done says ``cancelled``, and a hang ends."""
        self.events = [
            replace(e, finish_reason="cancelled") if isinstance(e, Done) else e for e in self.events
        ]
        self.hang_after = None
        self._woken.set()

    def _end(self) -> None:
        on_end, self._on_end = self._on_end, lambda: None
        on_end()


class FakeEngine(FakeBackend):
    """A GatewayBackend over the fake sessions: handles are FakeSessions, text tokenizes to
    character codes, Generate is scripted (started, the prompt snapshot, ``answer``'s tokens, with
    ``final_snapshot`` the generated snapshot when it commits past the prompt, done)."""

    def __init__(self, vocab_size: int = 1000, max_session_tokens: int = 256) -> None:
        super().__init__()
        self.owner = "prefix-service"
        self.instance_id = ""
        self.engine_instance = "instance-1"  # what Info reports; a test "restarts" the engine by changing it
        self.vocab_size, self.max_session_tokens = vocab_size, max_session_tokens
        self.clone_owners: list[str] = []  # the owner each clone_for() call cloned for
        self.closed_as: list[tuple[FakeSession, str | None]] = []
        self._streaming: dict[int, list[FakeStream]] = {}  # a session's Generate streams
        self.close_ends_streams = True  # False: a Close leaves its generation's stream as it was
        self.requests: list[EngineGenerate] = []
        self.streams: list[FakeStream] = []
        self.hang_after: int | None = None  # new streams hang after this many events
        self.take_clone_digests: list[bytes | None] = []  # expected_digest of each take_clone call
        self.reclaims = 0
        self.claims: list[FakeSession] = []  # claim() calls, in order
        self.claim_quota = 0  # > 0: claim() refuses (QuotaExceeded) while this many claimed sessions live
        self.describe_content = True
        self.max_sessions = 0  # Info's limits (0: not reported: the gateway's budget is its own bounds)
        self.max_positions = 0  # ... the engine's K/V positions bound (0: sessions x their tokens)
        self.kv_bytes_per_position = 0  # ... and one position's bytes (0: not reported)
        self.window_evicts = False  # Info's window: True models batched-sequence with sliding layers
        self.max_write = 64  # with window_evicts, a snapshot of n positions clones only at >= n - max_write
        self.say_window = True  # clone_or_refusal names WINDOW refusals (False: an engine that cannot say)
        self.info_calls = 0
        self.answer: tuple[int, ...] = (500,)  # what Generate streams; all but the last id are committed
        self.committed: tuple[int, ...] | None = None  # what the session commits instead (a lying engine)

    @property
    def sessions(self) -> FakeEngine:
        return self  # one object: the cache's handles and the gateway's calls

    def snapshot_files(self, call: CallContext | None = None) -> None:
        return None  # no snapshot files: moves are "unsupported"

    def info(self, call: CallContext | None = None) -> EngineInfo:
        self.info_calls += 1
        return EngineInfo(
            self.engine_instance,
            self.fingerprint,
            self.vocab_size,
            self.max_session_tokens,
            max_sessions=self.max_sessions,
            max_positions=self.max_positions,
            kv_bytes_per_position=self.kv_bytes_per_position,
            resident_sessions=len(self.live),
            window=WindowGeometry(max_write=self.max_write, evicts=self.window_evicts),
        )

    @property
    def max_rewind(self) -> int | None:
        return self.max_write if self.window_evicts else None

    def clone_or_refusal(self, handle: FakeSession, upto: int) -> TakenClone:
        child = self.clone(handle, upto)
        if child is not None:
            return TakenClone(child)
        if self.valid(handle) and upto > handle.position:
            return TakenClone(None, CloneRefusal.POSITION)
        below = self.valid(handle) and 0 <= upto <= handle.position and upto < handle.floor
        return TakenClone(None, CloneRefusal.WINDOW if below and self.say_window else CloneRefusal.BOUNDARY)

    def _snapshot(self, session: FakeSession, position: int, kind: str) -> Snapshot:
        """A snapshot event at ``position`` as the engine's capture takes it (with ``window_evicts``
        its floor is ``position - max_write``: the ring's, written == position)."""
        snap = self._do_clone(session, position)
        if snap is None:
            return Snapshot(None, position, kind, refusal="refused", reason=str(CloneRefusal.BOUNDARY))
        if self.window_evicts:
            snap.floor = max(snap.floor, position - self.max_write)
        return Snapshot(snap, position, kind, content_digest=digest_of(snap.tokens))

    def refresh(self, info: EngineInfo | None = None) -> EngineInfo:
        info = info if info is not None else self.info()
        self.instance_id = info.instance_id
        return info

    def await_serving(self, call: CallContext | None = None) -> None:
        """The fake engine always serves."""

    def clone_for(self, handle: FakeSession, upto: int, call: CallContext) -> TakenClone:
        self.clone_owners.append(call.owner)
        return self.clone_or_refusal(handle, upto)

    def adopt(self, handle: FakeSession, position: int, content_digest: bytes | None = None) -> None:
        assert handle.position == position and content_digest == digest_of(handle.tokens)

    def tokenize(self, text: TextPrompt, call: CallContext, message_ends: int = 0) -> Tokenized:
        return Tokenized(tuple(ord(c) for c in text.text))

    def detokenize(self, ids, call: CallContext) -> str:
        return "".join(chr(i) for i in ids)

    def describe(self, session: FakeSession, call: CallContext) -> Described:
        """As the engine: no content digest while generating (``describe_content`` False)."""
        self._known(session)
        return Described(session.position, digest_of(session.tokens) if self.describe_content else None)

    def take_clone(
        self, session: FakeSession, upto: int, call: CallContext, expected_digest: bytes | None = None
    ) -> TakenClone:
        """Like the engine: with ``expected_digest`` the clone happens only if [0, upto) holds it."""
        self.take_clone_digests.append(expected_digest)
        self._known(session)
        if upto > session.position:
            return TakenClone(None, CloneRefusal.POSITION)
        if expected_digest is not None:
            held = digest_of(session.tokens[:upto])
            if held is None:
                return TakenClone(None, CloneRefusal.PREPARED_INPUT)
            if held != expected_digest:
                return TakenClone(None, CloneRefusal.CONTENT_MISMATCH)
        child = self._do_clone(session, upto)
        return TakenClone(child) if child is not None else TakenClone(None, CloneRefusal.BOUNDARY)

    def close_as(self, session: FakeSession, call: CallContext | None = None) -> None:
        self._known(session)
        self.closed_as.append((session, call.owner if call is not None else None))
        for stream in self._streaming.pop(id(session), ()) if self.close_ends_streams else ():
            stream.session_closed()  # its generation ends, as the engine's does
        self._do_close(session)

    @staticmethod
    def _known(session: FakeSession) -> None:
        """As the engine: a closed session's handle is unknown (NotFound)."""
        if session.closed:
            raise NotFound(f"unknown session handle {session!r}")

    def claim(self, handle: FakeSession, call: CallContext | None = None) -> None:
        """As the engine: a closed session's handle is unknown (NotFound); ``claims`` records each."""
        self._known(handle)
        held = sum(not c.closed for c in {id(c): c for c in self.claims}.values())
        if self.claim_quota and held >= self.claim_quota:
            raise QuotaExceeded(self.owner, held, "sessions", "owner_max_sessions", self.claim_quota)
        self.claims.append(handle)

    def reclaim(self, call: CallContext | None = None) -> int:
        """The fake knows every session it made: nothing is unknown."""
        self.reclaims += 1
        return 0

    def generate(self, request: EngineGenerate) -> FakeStream:
        if request.close_session and not request.session:
            raise InvalidArgument("close_session only applies to a given session (session is empty)")
        self.requests.append(request)
        session = request.session or self.open(())
        start = session.position
        events: list = [Started(session, start, len(request.tokens))]
        fed = 0
        for point in request.config.prefill_breakpoints:  # prefill stops there; the engine clones
            if start < point <= start + len(request.tokens):
                session.extend(request.tokens[fed : point - start])
                fed = point - start
                events.append(self._snapshot(session, point, SnapshotKind.BREAKPOINT))
        session.extend(request.tokens[fed:])
        # as the engine streams them: the first token, then the prompt snapshot due at its update
        first = self.answer[:1] if request.prompt_snapshot else self.answer
        prompt = (
            self._snapshot(session, session.position, SnapshotKind.PROMPT)
            if request.prompt_snapshot
            else None
        )
        prompt_end = session.position
        session.extend(self.committed if self.committed is not None else self.answer[:-1])
        events.append(Tokens(first, "x" * len(first)))
        if prompt is not None:
            events.append(prompt)
            if self.answer[1:]:
                events.append(Tokens(self.answer[1:], "x" * len(self.answer[1:])))
        if request.final_snapshot and session.position > prompt_end:  # as the engine's capture.final
            events.append(self._snapshot(session, session.position, SnapshotKind.GENERATED))
        events.append(done_event(len(request.tokens), start))
        # a fresh session is closed as the call ends (not kept); a given one with close_session
        closes = not request.session or request.close_session
        stream = FakeStream(
            events, self.hang_after, (lambda: self._do_close(session)) if closes else lambda: None
        )
        self.streams.append(stream)
        self._streaming.setdefault(id(session), []).append(stream)
        return stream
