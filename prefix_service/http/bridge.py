"""GenerationBridge: one gateway generation driven from asyncio. The blocking fleet call and its stream
run on a worker thread, each event handed to the loop with ``call_soon_threadsafe``; :meth:`stop` ends
the engine generation at once and the stream's cleanup (drain, snapshots stored) runs on the worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import replace
from typing import Any

from engine_service.api.call_context import CallContext
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.resume import ResumingStream
from prefix_service.gateway.calls import GatewayEvent, GatewayRequest

log = logging.getLogger(__name__)


class _End:
    """The stream ended normally."""


_END = _End()


class GenerationBridge:
    """``start()`` once, then ``await next()`` until it returns None."""

    def __init__(self, fleet: Fleet, request: GatewayRequest, call: CallContext) -> None:
        self._fleet, self._call = fleet, call
        self._request = replace(request, caller_active=lambda: not self._stopped)  # ends a join's wait
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._lock = threading.Lock()
        self._stopped = False
        self._stream: ResumingStream | None = None

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
        try:
            self._generate()
        except BaseException as exc:  # noqa: BLE001 - errors travel to the handler as values
            self._put(exc)

    def _generate(self) -> None:
        stream = self._fleet.generate(self._request, self._call)
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
