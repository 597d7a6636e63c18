"""EngineBackend: one remote engine as the prefix service uses it, one part per protocol it meets, over
one :class:`EngineConnection` (stub, identity, deadlines, handles held)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from engine_service.api.owners import PERSISTENT_OWNER
from prefix_service.engines.engine_calls import EngineCalls
from prefix_service.engines.engine_connection import EngineConnection
from prefix_service.engines.engine_sessions import RemoteSessions


@dataclass(frozen=True)
class EngineBackend:
    """``sessions``: the cache's SessionBackend; ``calls``: the gateway's GatewayBackend (its
    ``snapshot_files(call)``: the tier's SnapshotBackend)."""

    connection: EngineConnection
    sessions: RemoteSessions
    calls: EngineCalls

    @classmethod
    def connect(
        cls,
        channel: grpc.Channel,
        *,
        owner: str = PERSISTENT_OWNER,
        timeout: float = 60.0,
        token: str | None = None,
    ) -> EngineBackend:
        connection = EngineConnection(channel, owner=owner, timeout=timeout, token=token)
        sessions = RemoteSessions(connection)
        return cls(connection, sessions, EngineCalls(connection, sessions))
