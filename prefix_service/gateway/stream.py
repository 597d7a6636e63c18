"""GatewayStream: one gateway Generate call in flight. The client reads the engine's events but its
``Snapshot`` events, which go to the gateway; however it ends, the engine stream is drained so no
snapshot is lost, as the caller of the call it holds."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Protocol

from engine_service.api.call_context import CallContext
from engine_service.api.errors import ForklineError
from engine_service.api.stream_events import Event, Snapshot, SnapshotKind, Started, Tokens
from prefix_service.cache.checkpoints import SnapshotRoom
from prefix_service.cache.outcomes import Match
from prefix_service.gateway.calls import GatewayEvent, GatewayRequest
from prefix_service.gateway.checkpoint_cadence import CheckpointCadence
from prefix_service.gateway.gateway_backend import EngineStream

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0  # how long a gateway call whose client left waits for the engine stream to end


class StreamHost(Protocol):
    """What a gateway stream asks of the gateway that started it."""

    cadence: CheckpointCadence  # decode checkpoints' stride, from the lags streams measure

    def store_snapshot(
        self, snapshot: Snapshot, request: GatewayRequest, tokens: Sequence[int], room: SnapshotRoom
    ) -> None:
        """Store (or release) a snapshot event of this call, in its reservation from ``room``."""

    def close_session(self, session: str, call: CallContext) -> bool:
        """Close ``call``'s session; False when the engine could not be told (logged, never raised)."""

    def written(self, request: GatewayRequest, tokens: Sequence[int]) -> bool:
        """Whether the snapshot directory holds ``tokens`` in ``request``'s scope now."""


class _StopOnce:
    """Ends the engine generation at most once: closes ``session`` (known by then), or cancels the
    engine call when there is none or it cannot be closed."""

    def __init__(self, host: StreamHost, stream: EngineStream, session: str, call: CallContext) -> None:
        self._host, self._stream, self.session, self._call = host, stream, session, call
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        if self.settle():
            return
        if not (self.session and self._host.close_session(self.session, self._call)):
            self._stream.cancel()

    def settle(self) -> bool:
        """From now on do nothing (the generation ended); whether that was so already."""
        with self._lock:
            done, self._done = self._done, True
        return done


class GatewayStream:
    """Iterate it once for the client's events (``first``: the one ``generate`` read); :meth:`stop`
    (any thread, idempotent) when the client leaves: it closes the generating session, so the
    snapshots the engine already sent are still read. ``room``: the reservations of its snapshots."""

    def __init__(
        self,
        host: StreamHost,
        stream: EngineStream,
        request: GatewayRequest,
        tokens: Sequence[int],
        match: Match | None,
        call: CallContext,
        first: Event | None = None,
        room: SnapshotRoom | None = None,
    ) -> None:
        self._host, self._stream, self._request = host, stream, request
        self._tokens = list(tokens)  # the prompt, then every id the engine streamed (a snapshot's key)
        self._first = first
        self._checkpoint: tuple[int, tuple[int, ...]] | None = None  # one on its way to the directory
        self._room = room if room is not None else SnapshotRoom()
        # its cleanup acts for the caller after the call's deadline (the client left, or it ended)
        cleanup = CallContext(call.owner, call.credential)
        # the session to close when the client leaves (even before the first event is read): the
        # match, or the fresh one ``Started`` names
        session = match.session if match else first.session if isinstance(first, Started) else ""
        self._stop = _StopOnce(host, stream, session, cleanup)

    def stop(self) -> None:
        """The client went away: end the engine generation."""
        self._stop()

    def __iter__(self) -> Generator[GatewayEvent, None, None]:
        ended = False
        first = [self._first] if self._first is not None else []
        try:
            for event in itertools.chain(first, self._stream):
                if self._held(event):
                    continue
                if isinstance(event, Started):
                    self._stop.session = self._stop.session or event.session
                    event = replace(event, session="")  # the gateway manages it: not the caller's to use
                yield event
            ended = True
        finally:
            if ended:
                self._stop.settle()  # a stop after the end (gRPC's callback) has nothing to end
            else:
                self._stop()
            self._drain()
            self._room.release()  # snapshots that never came (or were refused)

    def _held(self, event: Event) -> bool:
        """Note what ``event`` adds to the session's ids; a snapshot is stored here (True: not the client's)."""
        if isinstance(event, Tokens):
            self._watch_checkpoint()
            self._tokens.extend(event.ids)
        if not isinstance(event, Snapshot):
            return False
        self._host.store_snapshot(event, self._request, tuple(self._tokens), self._room)
        if event.kind == SnapshotKind.GENERATED and event.handle and self._host.cadence.measured:
            self._checkpoint = (event.position, tuple(self._tokens[: event.position]))  # replaces one
        return True

    def _watch_checkpoint(self) -> None:
        """Before more ids are added: once the directory holds the checkpoint on its way, tell the
        cadence how far past it the stream may have got meanwhile (every id held so far)."""
        if self._checkpoint is None:
            return
        position, key = self._checkpoint
        if self._host.written(self._request, key):
            self._host.cadence.landed(len(self._tokens) - position)
            self._checkpoint = None

    def _drain(self) -> None:
        """Read what is left of the engine stream so no snapshot handle it carries is lost; a stream
        that does not end within DRAIN_TIMEOUT_S is cancelled."""
        stream = self._stream
        timer = threading.Timer(DRAIN_TIMEOUT_S, stream.cancel)
        timer.daemon = True
        timer.start()
        try:
            for event in stream:
                self._held(event)
        except ForklineError:
            pass  # cancelled or failed: nothing more will arrive
        except Exception:  # noqa: BLE001 - cleanup must not mask the call's own outcome
            log.warning("could not drain a gateway engine stream", exc_info=True)
        finally:
            timer.cancel()
            stream.cancel()
