"""Awaiting a handler's work while watching for the client to leave (every route of the HTTP door)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from prefix_service.http.errors import ApiError

T = TypeVar("T")


async def until_disconnected(request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T:
    """Await ``work``; if the client disconnects first, call ``on_disconnect`` and give up (499)."""
    watcher = asyncio.ensure_future(_disconnected(request))
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({watcher, task}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            on_disconnect()
            task.cancel()
            raise ApiError(499, "the client disconnected", type="client_closed_request")
        return task.result()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
