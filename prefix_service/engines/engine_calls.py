"""EngineCalls: the gateway's GatewayBackend over a remote engine -- engine calls made for a call to the
prefix service, as its caller or as this service's owner."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc

from engine_service.api.answers import Described, TakenClone
from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import Unavailable
from engine_service.api.prompts import TextPrompt, Tokenized
from engine_service.api.stream_events import Event
from engine_service.serving import engine_wire
from engine_service.serving.auth import on_behalf_of
from engine_service.serving.engine_wire import event_from_proto
from engine_service.serving.errors import from_rpc_error
from prefix_service.engines.engine_connection import EngineConnection
from prefix_service.engines.engine_sessions import RemoteSessions
from prefix_service.engines.snapshot_files import EngineSnapshots
from prefix_service.gateway.gateway_backend import EngineGenerate
from protos import engine_pb2 as pb


class RemoteStream:
    """An engine Generate call as an ``EngineStream``: domain events, forkline errors. ``first_within``
    seconds (the caller's time left): the call is cancelled when its first event has not come by then
    (Unavailable, as a deadline would end it); after that the stream carries no deadline -- its caller
    ends it (closing the session), so every event the engine sent, each snapshot handle, is read."""

    def __init__(self, call: Iterator[pb.GenerateEvent], first_within: float | None = None) -> None:
        self._call = call
        self._late = False
        self._timer: threading.Timer | None = None
        if first_within is not None:
            self._timer = threading.Timer(first_within, self._too_late)
            self._timer.daemon = True
            self._timer.start()

    def _too_late(self) -> None:
        self._late = True
        self.cancel()

    def __iter__(self) -> RemoteStream:
        return self

    def __next__(self) -> Event:
        try:
            event = event_from_proto(next(self._call))
        except grpc.RpcError as exc:
            if self._late:
                raise Unavailable("the caller's deadline passed before the engine's first event") from None
            raise from_rpc_error(exc) from None
        finally:
            if self._timer is not None:
                self._timer.cancel()
        if self._late:  # the event raced the cancel: the stream is cut, what follows is lost
            raise Unavailable("the caller's deadline passed before the engine's first event")
        return event

    def cancel(self) -> None:
        self._call.cancel()  # type: ignore[attr-defined]  (a grpc call is also a grpc.Future)


class EngineCalls:
    """See the module docstring; ``sessions``: the same engine's handles as the cache holds them."""

    def __init__(self, connection: EngineConnection, sessions: RemoteSessions) -> None:
        self.connection, self.sessions = connection, sessions

    @property
    def owner(self) -> str:
        return self.connection.owner

    @property
    def instance_id(self) -> str:
        return self.connection.instance_id

    def info(self, call: CallContext | None = None) -> EngineInfo:
        return self.connection.info(call)

    def refresh(self, info: EngineInfo | None = None) -> EngineInfo:
        return self.connection.refresh(info)

    def await_serving(self, call: CallContext | None = None) -> None:
        """Wait while the engine is down, as an engine call would (no call is made)."""
        self.connection.call_options(self.connection.timeout, call)

    def adopt(self, handle: str, position: int, content_digest: bytes | None = None) -> None:
        self.connection.adopt(handle, position, content_digest)

    def snapshot_files(self, call: CallContext | None = None) -> EngineSnapshots:
        return EngineSnapshots(self.connection, call)

    def tokenize(self, text: TextPrompt, call: CallContext, message_ends: int = 0) -> Tokenized:
        conn = self.connection
        request = engine_wire.tokenize_request(text, message_ends, call.cache_scope)
        return engine_wire.tokenized(conn.call(conn.stub.Tokenize, request, call, as_caller=True))

    def detokenize(self, ids: Sequence[int], call: CallContext) -> str:
        conn = self.connection
        request = pb.DetokenizeRequest(ids=list(ids))
        return conn.call(conn.stub.Detokenize, request, call, as_caller=True).text

    def describe(self, session: str, call: CallContext) -> Described:
        conn = self.connection
        reply = conn.call(conn.stub.Describe, pb.DescribeRequest(session=session), call, as_caller=True)
        return Described(reply.position, reply.content_digest or None)

    def take_clone(
        self, session: str, upto: int, call: CallContext, expected_digest: bytes | None = None
    ) -> TakenClone:
        """Clone the caller's session into one this owner holds (adopted), only if it holds the
        ``expected_digest`` content when given (the engine checks); the refusal reason otherwise."""
        conn = self.connection
        request = pb.CloneRequest(
            session=session, upto=upto, new_owner=conn.owner, expected_content_digest=expected_digest or b""
        )
        reply = conn.call(conn.stub.Clone, request, call, as_caller=True)
        if reply.session:
            conn.adopt(reply.session, reply.position, reply.content_digest or None)
        return engine_wire.taken_clone(reply)

    def clone_for(self, handle: str, upto: int, call: CallContext) -> TakenClone:
        """Clone a stored snapshot into a session ``call``'s owner holds (this owner's call)."""
        conn = self.connection
        request = pb.CloneRequest(session=handle, upto=upto, new_owner=call.owner)
        # without the caller's deadline: a clone the engine made past it would reach nobody, and no
        # one could release it (the caller's Generate then fails on its deadline and closes it)
        reply = conn.call(conn.stub.Clone, request, CallContext(call.owner, call.credential))
        if reply.session and call.owner == conn.owner:
            conn.adopt(reply.session, reply.position, reply.content_digest or None)
        return engine_wire.taken_clone(reply)

    def close_as(self, session: str, call: CallContext | None = None) -> None:
        conn = self.connection
        conn.call(conn.stub.Close, pb.CloseRequest(session=session), call, as_caller=True, release=True)

    def generate(self, request: EngineGenerate) -> RemoteStream:
        """Start an engine Generate as ``request.call``'s caller (its session counts against the
        caller's quota), its snapshots handed to this owner."""
        conn, call = self.connection, request.call
        as_caller = call is not None and call.owner != conn.owner
        metadata = on_behalf_of(call) if as_caller else conn.metadata
        message = engine_wire.engine_request(request, snapshot_owner=conn.owner if as_caller else "")
        options = conn.call_options(None, call)
        first_within = options.pop("timeout")  # the caller's deadline bounds the start, not the stream
        return RemoteStream(conn.stub.Generate(message, metadata=metadata, **options), first_within)

    def claim(self, handle: str, call: CallContext | None = None) -> None:
        """Take over the quota charge of a handle a caller handed to this owner (it counted against
        the caller until now)."""
        conn = self.connection
        conn.call(conn.stub.Claim, pb.ClaimRequest(session=handle), call)

    def reclaim(self, call: CallContext | None = None) -> int:
        """Close what this owner pays for in the engine except the handles it adopted (e.g. a claim
        it lost track of); how many. Hand-overs still charged to their callers stay: they do not
        fill this owner's quota, and some are captures on their way to it."""
        conn = self.connection
        request = pb.ReleaseOwnerRequest(keep=conn.held(), paid_only=True)
        return conn.call(conn.stub.ReleaseOwner, request, call).released

    def release_owned(self) -> int:
        """Close everything this owner holds in the engine (leftovers of an earlier run)."""
        conn = self.connection
        released = conn.call(conn.stub.ReleaseOwner, pb.ReleaseOwnerRequest()).released
        conn.forget()
        return released
