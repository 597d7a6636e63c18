"""GatewayStream: one gateway Generate call in flight, as :meth:`Gateway.generate` returns it.

Iterating yields the client's events (the engine's first event, already read by ``generate``, then the
rest; ``Snapshot`` events are stored by the gateway, never passed on). When the client leaves,
:meth:`GatewayStream.stop` ends the engine generation once (:class:`_StopOnce`). At the end, however
the iteration ends, the engine stream is drained, the snapshots' reservations released and the matched
clone closed, with the caller's credential (the caller current when the stream was made) whichever
thread runs it.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from engine_service.api.stream_events import Event, Snapshot, Started
from engine_service.serving.tokens import Caller, calling_as, current_caller
from prefix_service.cache.checkpoints import SnapshotRoom
from prefix_service.cache.outcomes import Match
from prefix_service.gateway.gateway_backend import EngineStream

if TYPE_CHECKING:  # the gateway imports this module
    from prefix_service.gateway.gateway import Gateway, GatewayEvent, GatewayRequest


class _StopOnce:
    """Calls ``stop(stream, session)`` at most once, with the session known by then."""

    def __init__(self, stop: Callable[[EngineStream, str], None], stream: EngineStream, session: str) -> None:
        self._stop, self._stream, self.session = stop, stream, session
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._stop(self._stream, self.session)


class GatewayStream:
    """One gateway Generate call in flight (made by :meth:`Gateway.generate`, which read ``first``).

    Iterate it once for the client's events; call :meth:`stop` (any thread, idempotent) when the
    client leaves. The engine stream is always drained, the snapshots' reservations (``room``: the
    prompt end's and each checkpoint's) released and the matched clone closed at the end. Calls for the caller (``owner``) carry its credential from any
    thread (the caller current when the stream was made).
    """

    def __init__(
        self,
        gateway: Gateway,
        stream: EngineStream,
        request: GatewayRequest,
        tokens: Sequence[int],
        match: Match | None,
        owner: str,
        first: Event | None = None,
        room: SnapshotRoom | None = None,
    ) -> None:
        self._gateway, self._stream, self._request, self._tokens = gateway, stream, request, tokens
        self._match, self._owner, self._first = match, owner, first
        self._room = room if room is not None else SnapshotRoom()
        self._caller: Caller | None = current_caller()
        # The session to close when the client leaves: the match, or the fresh one `started` names.
        self._stop = _StopOnce(
            lambda engine_stream, session: gateway._stop_generation(engine_stream, session, owner),
            stream,
            match.session if match else "",
        )

    def _as_caller(self) -> contextlib.AbstractContextManager[None]:
        return calling_as(self._caller) if self._caller is not None else contextlib.nullcontext()

    def stop(self) -> None:
        """The client went away: end the engine generation (see the module docstring)."""
        with self._as_caller():
            self._stop()

    def __iter__(self) -> Generator[GatewayEvent, None, None]:
        gateway, ended = self._gateway, False
        first = [self._first] if self._first is not None else []
        try:
            for event in itertools.chain(first, self._stream):
                if isinstance(event, Snapshot):
                    gateway._take_snapshot(event, self._request, self._tokens, self._room)
                    continue
                if isinstance(event, Started):
                    self._stop.session = self._stop.session or event.session
                    event = replace(event, session="")  # the gateway manages it: not the caller's to use
                yield event
            ended = True
        finally:
            with self._as_caller():
                if not ended:
                    self._stop()
                gateway._drain(self._stream, self._request, self._tokens, self._room)
                self._room.release()  # snapshots that never came (or were refused)
                if self._match is not None:
                    gateway._close_quietly(self._match.session, self._owner)
