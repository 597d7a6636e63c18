"""ChannelClient: what every typed forkline client shares (channel, owner metadata, error mapping)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from engine_service.rpc.convert import OWNER_METADATA_KEY
from engine_service.rpc.errors import from_rpc_error


class ChannelClient:
    """Owns (or borrows) a channel; sends ``forkline-owner`` metadata; maps failures to domain errors.

    ``target`` is ``host:port`` (the client opens and closes the channel) or an open channel (borrowed).
    """

    def __init__(self, target: str | grpc.Channel, *, owner: str = "anonymous", timeout: float | None = 60.0) -> None:
        self._own_channel = isinstance(target, str)
        self.channel = grpc.insecure_channel(target) if isinstance(target, str) else target
        self.owner = owner
        self.timeout = timeout
        self._metadata = ((OWNER_METADATA_KEY, owner),)

    def close_channel(self) -> None:
        if self._own_channel:
            self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_channel()

    def _unary(self, method: Callable[..., Any], request: Any) -> Any:
        """Call a unary RPC with this client's metadata and timeout; raise the domain error on failure."""
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
