"""RemoteSessions: the cache's SessionBackend over a remote engine; handles are engine handle strings,
held under this service's owner id."""

from __future__ import annotations

import contextlib

from engine_service.api.answers import TakenClone
from engine_service.api.errors import NotFound
from engine_service.api.handle_names import handle_instance
from engine_service.serving import engine_wire
from prefix_service.engines.engine_connection import EngineConnection
from protos import engine_pb2 as pb


class RemoteSessions:
    """Positions, digests and validity of adopted handles answer without a call; a handle of another
    engine instance is invalid without asking."""

    def __init__(self, connection: EngineConnection) -> None:
        self.connection = connection

    @property
    def fingerprint(self) -> str:
        return self.connection.fingerprint

    @property
    def max_rewind(self) -> int | None:
        return self.connection.max_rewind

    @property
    def clone_shared_share(self) -> float:
        return self.connection.clone_shared_share

    @property
    def clone_shared_ring_positions(self) -> int:
        return self.connection.clone_shared_ring_positions

    def clone(self, handle: str, upto: int) -> str | None:
        return self.clone_or_refusal(handle, upto).handle

    def clone_or_refusal(self, handle: str, upto: int) -> TakenClone:
        """A clone this owner holds (adopted), or why the engine refused (``WINDOW``: below a ring's floor)."""
        conn = self.connection
        reply = conn.call(conn.stub.Clone, pb.CloneRequest(session=handle, upto=upto, new_owner=conn.owner))
        if reply.session:
            conn.adopt(reply.session, reply.position, reply.content_digest or None)
        return engine_wire.taken_clone(reply)

    def close(self, handle: str) -> None:
        conn = self.connection
        conn.forget(handle)
        if handle_instance(handle) != conn.instance_id:
            return  # issued by an engine that is gone: nothing to release
        with contextlib.suppress(NotFound):
            conn.call(conn.stub.Close, pb.CloseRequest(session=handle), release=True)

    def position(self, handle: str) -> int:
        known = self.connection.known_position(handle)
        if known is not None:
            return known
        return self._describe(handle).position

    def content_digest(self, handle: str) -> bytes | None:
        """What the engine reported the handle holds when it was adopted (no call), else Describe's."""
        adopted, digest = self.connection.known_digest(handle)
        if adopted:
            return digest
        return self._describe(handle).content_digest or None

    def valid(self, handle: str) -> bool:
        if not isinstance(handle, str) or handle_instance(handle) != self.connection.instance_id:
            return False
        return self.connection.known_position(handle) is not None

    def held(self) -> int:
        """Handles this backend believes it holds."""
        return len(self.connection.held())

    def _describe(self, handle: str) -> pb.DescribeResponse:
        conn = self.connection
        return conn.call(conn.stub.Describe, pb.DescribeRequest(session=handle))
