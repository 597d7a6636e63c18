"""EngineBackend: the cache's SessionBackend, the gateway's GatewayBackend and the tier's SnapshotBackend
over one remote engine (its gRPC stub).

Handles are the engine's session handle strings. Snapshots are held under the backend's own owner id
(``owner``); :meth:`clone` gives the new session to the ``cloning_for`` owner of the current call (a
lookup's caller), else to itself. It remembers the positions and content digests of the handles it
holds, so ``position``, ``valid`` and ``content_digest`` usually make no call; a handle of another
engine instance is invalid without asking. Engine errors arrive as ``engine_service.api.errors``
types, also from a Generate stream (:class:`RemoteStream`). Every call carries the deadline of the RPC
it serves (capped by ``timeout``) and, while the engine is down, first waits for it (``engine_watch.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from engine_service.api.answers import Described, ImportedSnapshot, TakenClone
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import NotFound
from engine_service.api.handle_names import handle_instance
from engine_service.api.owners import PERSISTENT_OWNER
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Event
from engine_service.serving import engine_wire
from engine_service.serving.auth import ClientSecurity, on_behalf_of
from engine_service.serving.engine_wire import engine_info, event_from_proto
from engine_service.serving.errors import from_rpc_error
from prefix_service.engines.engine_watch import EngineWatch, call_timeout
from prefix_service.gateway.gateway_backend import EngineGenerate
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc

SNAPSHOT_TIMEOUT_S = 120.0  # one snapshot file's export or import (off the request path)
PROBE_TIMEOUT_S = 1.0  # EngineBackend.probe: an engine that answers at all answers Info within this

_clone_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "forkline_clone_owner", default=None
)

Reply = TypeVar("Reply", bound=Message)


class RemoteStream:
    """An engine Generate call as an :class:`~prefix_service.gateway.gateway_backend.EngineStream`: domain events,
    forkline errors (a cancelled call raises Cancelled)."""

    def __init__(self, call: Iterator[pb.GenerateEvent]) -> None:
        self._call = call

    def __iter__(self) -> RemoteStream:
        return self

    def __next__(self) -> Event:
        try:
            return event_from_proto(next(self._call))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._call.cancel()  # type: ignore[attr-defined]  (a grpc call is also a grpc.Future)


class EngineBackend:
    """See the module docstring. ``refresh()`` reads the engine's identity (Info) and returns it."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        owner: str = PERSISTENT_OWNER,
        timeout: float = 60.0,
        token: str | None = None,
    ) -> None:
        self.stub = engine_pb2_grpc.EngineStub(channel)
        self.owner = owner
        self.timeout = timeout
        self.watch: EngineWatch | None = None  # the engine's health, when watched (engine_watch.py)
        self.metadata = ClientSecurity(token=token).metadata(owner)  # its own calls: its own token
        self._lock = threading.Lock()
        self._positions: dict[str, int] = {}
        self._digests: dict[str, bytes | None] = {}  # what the engine said each adopted handle holds
        self.instance_id = ""
        self._fingerprint = ""
        self.max_rewind: int | None = None  # session_backend.max_rewind, from Info's window geometry

    def call(
        self,
        method: Callable[..., Reply],
        request: Message,
        owner: str | None = None,
        *,
        release: bool = False,
    ) -> Reply:
        """A unary engine call as ``owner`` (default: this backend); errors as forkline errors. For a
        caller it forwards the caller's own credential when it authenticated here (engine_service/serving/auth.py).

        ``release``: a Close that cleans up after the caller (e.g. the clone of a lookup whose caller
        already left) runs on the backend's own timeout, not the caller's spent deadline, and does not
        wait for a down engine (whose restart releases everything anyway)."""
        metadata = self.metadata if owner is None else on_behalf_of(owner)
        options = {"timeout": self.timeout} if release else self.call_options(self.timeout)
        try:
            return method(request, metadata=metadata, **options)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def call_options(self, cap: float | None) -> dict[str, Any]:
        """``timeout`` and ``wait_for_ready`` for an engine call: the caller's time left, at most
        ``cap``. While the engine is down it first waits for it (Unavailable when it stays down). A
        call nothing bounds does not wait for a connection (the watch just saw the engine SERVING)."""
        timeout = call_timeout(cap)
        if self.watch is not None:
            self.watch.await_serving(timeout)
        return {"timeout": timeout, "wait_for_ready": timeout is not None}

    def await_serving(self) -> None:
        """Wait while the engine is down, as an engine call would (no call is made)."""
        self.call_options(self.timeout)

    def info(self) -> EngineInfo:
        return engine_info(self.call(self.stub.Info, pb.InfoRequest()))

    def probe(self, timeout: float = PROBE_TIMEOUT_S) -> EngineInfo | None:
        """The engine's Info now, without waiting for a down engine or adopting anything (None: no
        answer within ``timeout``): a draining engine (health NOT_SERVING) still answers it."""
        try:
            return engine_info(self.stub.Info(pb.InfoRequest(), metadata=self.metadata, timeout=timeout))
        except grpc.RpcError:
            return None

    def refresh(self, info: EngineInfo | None = None) -> EngineInfo:
        """Adopt the engine's instance id, fingerprint and window from ``info`` (None: read Info now)."""
        info = info if info is not None else self.info()
        with self._lock:
            if info.instance_id != self.instance_id:
                self._positions.clear()  # handles of the previous instance are all dead
                self._digests.clear()
            self.instance_id = info.instance_id
            self._fingerprint = info.fingerprint
            self.max_rewind = info.max_rewind
        return info

    def release_owned(self) -> int:
        """Close everything this owner holds in the engine (leftovers of an earlier run)."""
        released = self.call(self.stub.ReleaseOwner, pb.ReleaseOwnerRequest()).released
        with self._lock:
            self._positions.clear()
            self._digests.clear()
        return released

    @contextlib.contextmanager
    def cloning_for(self, owner: str) -> Iterator[None]:
        """Within the block, :meth:`clone` gives new sessions to ``owner``."""
        token = _clone_owner.set(owner)
        try:
            yield
        finally:
            _clone_owner.reset(token)

    def adopt(self, handle: str, position: int, content_digest: bytes | None = None) -> None:
        """Record a handle this backend owns (e.g. a snapshot event), its position and the content
        digest the engine reported for it (None: a prepared input, or not reported: never stored)."""
        with self._lock:
            self._positions[handle] = position
            self._digests[handle] = content_digest

    # -- GatewayBackend: engine calls on behalf of a caller ------------------------------------
    def tokenize(self, text: TextPrompt, owner: str) -> list[int]:
        return list(
            self.call(self.stub.Tokenize, pb.TokenizeRequest(text=engine_wire.text_input(text)), owner).ids
        )

    def describe(self, session: str, owner: str) -> Described:
        reply = self.call(self.stub.Describe, pb.DescribeRequest(session=session), owner)
        return Described(reply.position, reply.content_digest or None)

    def take_clone(
        self, session: str, upto: int, owner: str, expected_digest: bytes | None = None
    ) -> TakenClone:
        """Clone ``owner``'s session into one this backend owns (and adopts), only if it holds the
        ``expected_digest`` content when given (the engine checks); the refusal reason otherwise."""
        request = pb.CloneRequest(
            session=session, upto=upto, new_owner=self.owner, expected_content_digest=expected_digest or b""
        )
        reply = self.call(self.stub.Clone, request, owner)
        if reply.session:
            self.adopt(reply.session, reply.position, reply.content_digest or None)
        return engine_wire.taken_clone(reply)

    def close_as(self, session: str, owner: str | None = None) -> None:
        self.call(self.stub.Close, pb.CloseRequest(session=session), owner, release=True)

    def generate(self, request: EngineGenerate) -> RemoteStream:
        """Start an engine Generate as ``request.owner`` (its caller: the session counts against the
        caller's quota), its prompt snapshot handed to this backend's owner."""
        owner = request.owner if request.owner and request.owner != self.owner else None
        metadata = self.metadata if owner is None else on_behalf_of(owner)
        message = engine_wire.engine_request(request, snapshot_owner=self.owner if owner else "")
        return RemoteStream(self.stub.Generate(message, metadata=metadata, **self.call_options(None)))

    def claim(self, handle: str) -> None:
        """Take over the quota charge of a handle a caller handed to this owner (its Insert's clone, a
        gateway capture's snapshot): it counted against the caller until now."""
        self.call(self.stub.Claim, pb.ClaimRequest(session=handle))

    def reclaim(self) -> int:
        """Close what this owner holds in the engine except the handles this backend knows (adopted:
        stored snapshots, inserts being made): e.g. clones a client handed to it and never inserted.
        A clone made meanwhile and not adopted yet is released too (its entry is then dropped as
        dead at its next lookup)."""
        with self._lock:
            keep = list(self._positions)
        return self.call(self.stub.ReleaseOwner, pb.ReleaseOwnerRequest(keep=keep)).released

    # -- SessionBackend ------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def clone(self, handle: str, upto: int) -> str | None:
        return self.clone_or_refusal(handle, upto).handle

    def clone_or_refusal(self, handle: str, upto: int) -> TakenClone:
        """:meth:`clone`, and why the engine refused (``CloneRefusal.WINDOW``: below a ring's floor)."""
        new_owner = _clone_owner.get() or self.owner
        reply = self.call(self.stub.Clone, pb.CloneRequest(session=handle, upto=upto, new_owner=new_owner))
        if reply.session and new_owner == self.owner:
            self.adopt(reply.session, reply.position, reply.content_digest or None)
        return engine_wire.taken_clone(reply)

    def close(self, handle: str) -> None:
        with self._lock:
            self._positions.pop(handle, None)
            self._digests.pop(handle, None)
        if handle_instance(handle) != self.instance_id:
            return  # issued by an engine that is gone: nothing to release
        with contextlib.suppress(NotFound):
            self.call(self.stub.Close, pb.CloseRequest(session=handle), release=True)

    def position(self, handle: str) -> int:
        with self._lock:
            known = self._positions.get(handle)
        if known is not None:
            return known
        return self.call(self.stub.Describe, pb.DescribeRequest(session=handle)).position

    def content_digest(self, handle: str) -> bytes | None:
        """What the engine reported the handle holds when it was adopted (no call), else Describe's."""
        with self._lock:
            if handle in self._digests:
                return self._digests[handle]
        return self.call(self.stub.Describe, pb.DescribeRequest(session=handle)).content_digest or None

    def valid(self, handle: str) -> bool:
        if not isinstance(handle, str) or handle_instance(handle) != self.instance_id:
            return False
        with self._lock:
            return handle in self._positions

    def held(self) -> int:
        """Handles this backend believes it holds."""
        with self._lock:
            return len(self._positions)

    # -- snapshot files (the persistent tier) -------------------------------------------------------
    def export_session(
        self, handle: str, extra: Mapping[str, str], upto: int | None = None
    ) -> Iterator[bytes] | None:
        """The snapshot file of ``handle`` (positions ``[0, upto)``, default all) as chunks
        (SnapshotBackend); None when the engine refused."""
        call = self.stub.ExportSession(
            pb.ExportSessionRequest(session=handle, extra=dict(extra), upto=upto),
            metadata=self.metadata,
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
        """Load a snapshot file into a new session this backend owns and adopt it (SnapshotBackend)."""
        requests = (pb.SnapshotChunk(data=data) for data in chunks)
        try:
            reply = self.stub.ImportSession(
                requests, metadata=self.metadata, **self.call_options(SNAPSHOT_TIMEOUT_S)
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        if not reply.session:
            return ImportedSnapshot(None, reply.refusal, reply.detail)
        digest = reply.content_digest or None
        self.adopt(reply.session, reply.positions, digest)
        return ImportedSnapshot(reply.session, positions=reply.positions, content_digest=digest)
