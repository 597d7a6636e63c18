"""EngineSnapshots: the tier's SnapshotBackend over a remote engine -- snapshot files exported and
imported as this service's owner, for one call (its deadline) or none."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import grpc

from engine_service.api.answers import ImportedSnapshot
from engine_service.api.call_context import CallContext
from engine_service.serving.errors import from_rpc_error
from prefix_service.engines.engine_connection import EngineConnection
from protos import engine_pb2 as pb

SNAPSHOT_TIMEOUT_S = 120.0  # one snapshot file's export or import (off the request path)


class EngineSnapshots:
    def __init__(self, connection: EngineConnection, call: CallContext | None = None) -> None:
        self.connection, self.call = connection, call

    def export_session(
        self, handle: str, extra: Mapping[str, str], upto: int | None = None
    ) -> Iterator[bytes] | None:
        """The snapshot file of ``handle`` (positions ``[0, upto)``, default all) as chunks; None when
        the engine refused."""
        conn = self.connection
        call = conn.stub.ExportSession(
            pb.ExportSessionRequest(session=handle, extra=dict(extra), upto=upto),
            metadata=conn.metadata,
            timeout=SNAPSHOT_TIMEOUT_S,
        )
        try:
            first = next(call, None)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        if first is None or first.refusal:
            call.cancel()
            return None

        def chunks() -> Iterator[bytes]:
            try:
                yield first.data
                for chunk in call:
                    yield chunk.data
            except grpc.RpcError as exc:
                raise from_rpc_error(exc) from None
            finally:
                call.cancel()

        return chunks()

    def import_session(self, chunks: Iterable[bytes]) -> ImportedSnapshot:
        """Load a snapshot file into a new session this owner holds (adopted)."""
        conn = self.connection
        requests = (pb.SnapshotChunk(data=data) for data in chunks)
        try:
            reply = conn.stub.ImportSession(
                requests, metadata=conn.metadata, **conn.call_options(SNAPSHOT_TIMEOUT_S, self.call)
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        if not reply.session:
            return ImportedSnapshot(None, reply.refusal, reply.detail)
        digest = reply.content_digest or None
        conn.adopt(reply.session, reply.positions, digest)
        return ImportedSnapshot(reply.session, positions=reply.positions, content_digest=digest)
