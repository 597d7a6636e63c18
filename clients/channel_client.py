"""ChannelClient: what every typed forkline client shares (channel, owner metadata and credentials,
error mapping)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from engine_service.api.owners import DEFAULT_OWNER
from engine_service.serving.auth import ClientSecurity
from engine_service.serving.errors import from_rpc_error


class ChannelClient:
    """Sends ``forkline-owner`` (and, with ``token``, a bearer token: a server with tokens runs the call
    as the token's owner) and maps failures to domain errors. ``target``: ``host:port`` (opened and
    closed here) or an open channel (borrowed); ``tls_ca``: TLS; ``tls_cert`` / ``tls_key``: mutual TLS
    (PEM files)."""

    def __init__(
        self,
        target: str | grpc.Channel,
        *,
        owner: str = DEFAULT_OWNER,
        timeout: float | None = 60.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        security = ClientSecurity(token, tls_ca, tls_cert, tls_key)
        self._own_channel = isinstance(target, str)
        self.channel = security.channel(target) if isinstance(target, str) else target
        self.owner = owner
        self.timeout = timeout
        self._metadata = security.metadata(owner)

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
