"""GatewayStream: one gateway Generate call in flight, as :meth:`Gateway.generate` returns it.

Iterating yields the client's events: the engine's first event (already read by ``generate``), then
the rest; ``Snapshot`` events go to the gateway (:class:`StreamHost`), never to the client. When the
client leaves, :meth:`GatewayStream.stop` ends the engine generation once, by closing its session, so
the snapshots the engine already sent are still read. However the iteration ends, the engine stream is
drained (cancelled after ``DRAIN_TIMEOUT_S``) and the snapshots' reservations released, with the
caller's credential (the caller current when the stream was made). The matched clone is the engine
call's (``EngineGenerate.close_session``): the engine closes it as the call ends.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Protocol

from engine_service.api.errors import ForklineError
from engine_service.api.stream_events import Event, Snapshot, Started
from engine_service.serving.tokens import Caller, calling_as, current_caller
from prefix_service.cache.checkpoints import SnapshotRoom
from prefix_service.cache.outcomes import Match
from prefix_service.gateway.calls import GatewayEvent, GatewayRequest
from prefix_service.gateway.gateway_backend import EngineStream

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0  # how long a gateway call whose client left waits for the engine stream to end


class StreamHost(Protocol):
    """What a gateway stream asks of the gateway that started it."""

    def store_snapshot(
        self, snapshot: Snapshot, request: GatewayRequest, tokens: Sequence[int], room: SnapshotRoom
    ) -> None:
        """Store (or release) a snapshot event of this call, in its reservation from ``room``."""

    def close_session(self, session: str, owner: str) -> bool:
        """Close ``owner``'s session; False when the engine could not be told (logged, never raised)."""


class _StopOnce:
    """Ends the engine generation at most once: closes ``session`` (known by then), or cancels the
    engine call when there is none or it cannot be closed."""

    def __init__(self, host: StreamHost, stream: EngineStream, session: str, owner: str) -> None:
        self._host, self._stream, self.session, self._owner = host, stream, session, owner
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        if self.settle():
            return
        if not (self.session and self._host.close_session(self.session, self._owner)):
            self._stream.cancel()

    def settle(self) -> bool:
        """From now on do nothing (the generation ended); whether that was so already."""
        with self._lock:
            done, self._done = self._done, True
        return done


class GatewayStream:
    """One gateway Generate call in flight (made by :meth:`Gateway.generate`, which read ``first``).

    Iterate it once for the client's events; call :meth:`stop` (any thread, idempotent) when the
    client leaves. ``room``: the reservations of the call's snapshots (the prompt end's and each
    checkpoint's)."""

    def __init__(
        self,
        host: StreamHost,
        stream: EngineStream,
        request: GatewayRequest,
        tokens: Sequence[int],
        match: Match | None,
        owner: str,
        first: Event | None = None,
        room: SnapshotRoom | None = None,
    ) -> None:
        self._host, self._stream, self._request, self._tokens = host, stream, request, tokens
        self._owner, self._first = owner, first
        self._room = room if room is not None else SnapshotRoom()
        self._caller: Caller | None = current_caller()
        # the session to close when the client leaves: the match, or the fresh one `started` names
        self._stop = _StopOnce(host, stream, match.session if match else "", owner)

    def _as_caller(self) -> contextlib.AbstractContextManager[None]:
        return calling_as(self._caller) if self._caller is not None else contextlib.nullcontext()

    def stop(self) -> None:
        """The client went away: end the engine generation (see the module docstring)."""
        with self._as_caller():
            self._stop()

    def __iter__(self) -> Generator[GatewayEvent, None, None]:
        ended = False
        first = [self._first] if self._first is not None else []
        try:
            for event in itertools.chain(first, self._stream):
                if isinstance(event, Snapshot):
                    self._host.store_snapshot(event, self._request, self._tokens, self._room)
                    continue
                if isinstance(event, Started):
                    self._stop.session = self._stop.session or event.session
                    event = replace(event, session="")  # the gateway manages it: not the caller's to use
                yield event
            ended = True
        finally:
            with self._as_caller():
                if ended:
                    self._stop.settle()  # a stop after the end (gRPC's callback) has nothing to end
                else:
                    self._stop()
                self._drain()
                self._room.release()  # snapshots that never came (or were refused)

    def _drain(self) -> None:
        """Read what is left of the engine stream so no snapshot handle it carries is lost; a stream
        that does not end within DRAIN_TIMEOUT_S is cancelled."""
        stream = self._stream
        timer = threading.Timer(DRAIN_TIMEOUT_S, stream.cancel)
        timer.daemon = True
        timer.start()
        try:
            for event in stream:
                if isinstance(event, Snapshot):
                    self._host.store_snapshot(event, self._request, self._tokens, self._room)
        except ForklineError:
            pass  # cancelled or failed: nothing more will arrive
        except Exception:  # noqa: BLE001 - cleanup must not mask the call's own outcome
            log.warning("could not drain a gateway engine stream", exc_info=True)
        finally:
            timer.cancel()
            stream.cancel()
