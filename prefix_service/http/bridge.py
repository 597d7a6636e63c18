"""One gateway generation driven from asyncio: the blocking gateway on a worker thread, its events
delivered to the event loop.

:meth:`Fleet.generate` blocks (tokenize, the lookup's clone, the engine's first event) and its stream is a
blocking iterator, so both run on a thread of their own; each event is handed to the event loop with
``call_soon_threadsafe`` (no polling). :meth:`GenerationBridge.stop` -- a client that disconnected,
a stop string that matched, a server that is shutting down -- ends the engine generation at once
(``GatewayStream.stop()``) and makes the worker close the gateway stream, whose cleanup drains the
engine stream (storing the prompt snapshot) and closes the matched clone: no engine session outlives
the request. The worker runs as the authenticated caller (``engine_service.serving.tokens.calling_as``), so the
gateway forwards the caller's credential to the engine like the gRPC door does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from engine_service.serving.tokens import Caller, calling_as
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.member import RoutedStream
from prefix_service.gateway.calls import GatewayEvent, GatewayRequest

log = logging.getLogger(__name__)


class _End:
    """The stream ended normally."""


_END = _End()


class GenerationBridge:
    """See the module docstring. ``start()`` once, then ``await next()`` until it returns None."""

    def __init__(self, gateway: Fleet, request: GatewayRequest, owner: str, caller: Caller | None) -> None:
        self._gateway, self._request, self._owner, self._caller = gateway, request, owner, caller
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._lock = threading.Lock()
        self._stopped = False
        self._stream: RoutedStream | None = None

    def start(self) -> None:
        threading.Thread(target=self._run, name="forkline-http-generation", daemon=True).start()

    async def next(self) -> GatewayEvent | None:
        """The next event; None at the end; a failure raises its (forkline) exception."""
        item = await self._queue.get()
        if item is _END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """End the generation (any thread, idempotent); the worker stops delivering."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            stream = self._stream
        if stream is not None:
            stream.stop()

    # -- the worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        with calling_as(self._caller) if self._caller else contextlib.nullcontext():
            try:
                self._generate()
            except BaseException as exc:  # noqa: BLE001 - errors travel to the handler as values
                self._put(exc)

    def _generate(self) -> None:
        stream = self._gateway.generate(self._request, self._owner)
        with self._lock:
            self._stream, stopped = stream, self._stopped
        if stopped:
            stream.stop()
        # closing() runs the gateway stream's cleanup (stop + drain + close the match) on an early exit
        with contextlib.closing(iter(stream)) as events:
            for event in events:
                if self._stopped:
                    return
                self._put(event)
        self._put(_END)

    def _put(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server stopped, nobody reads any more
            self.stop()
