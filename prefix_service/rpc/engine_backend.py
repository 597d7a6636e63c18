"""EngineBackend: the prefix cache's SessionBackend over a remote engine (the engine gRPC stub).

Handles are the engine's opaque session handle strings. The backend holds its snapshots in the engine
under its own owner id (``owner``, default ``prefix-service``); :meth:`clone` gives the new session to
``clone_owner`` when one is set for the current call (a Lookup hands the clone to its caller) and to
itself otherwise.

It remembers the positions of the handles it holds (snapshot events and clones say them), so
``position`` and ``valid`` usually cost no call. ``valid`` is False for a handle issued by another
engine instance: after an engine restart every stored handle is dead without asking the engine.
Engine errors arrive as ``engine_service.errors`` types (the PrefixCache treats them as refusals).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

import grpc

from engine_service.errors import NotFound
from engine_service.handles import handle_instance
from engine_service.rpc.convert import OWNER_METADATA_KEY
from engine_service.rpc.errors import from_rpc_error
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc

DEFAULT_OWNER = "prefix-service"

_clone_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar("forkline_clone_owner", default=None)


class EngineBackend:
    """See the module docstring. ``refresh()`` reads the engine's identity (Info) and returns it."""

    def __init__(self, channel: grpc.Channel, *, owner: str = DEFAULT_OWNER, timeout: float = 60.0) -> None:
        self.stub = engine_pb2_grpc.EngineStub(channel)
        self.owner = owner
        self.timeout = timeout
        self.metadata = ((OWNER_METADATA_KEY, owner),)
        self._lock = threading.Lock()
        self._positions: dict[str, int] = {}
        self.instance_id = ""
        self._fingerprint = ""

    def call(self, method, request, owner: str | None = None):
        """A unary engine call as ``owner`` (default: this backend); errors as forkline errors."""
        metadata = self.metadata if owner is None else ((OWNER_METADATA_KEY, owner),)
        try:
            return method(request, metadata=metadata, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def info(self) -> pb.InfoResponse:
        return self.call(self.stub.Info, pb.InfoRequest())

    def refresh(self) -> pb.InfoResponse:
        """Read Info and adopt the engine's instance id and fingerprint."""
        info = self.info()
        with self._lock:
            if info.instance_id != self.instance_id:
                self._positions.clear()  # handles of the previous instance are all dead
            self.instance_id = info.instance_id
            self._fingerprint = info.fingerprint
        return info

    def release_owned(self) -> int:
        """Close everything this owner holds in the engine (leftovers of an earlier run)."""
        released = self.call(self.stub.ReleaseOwner, pb.ReleaseOwnerRequest()).released
        with self._lock:
            self._positions.clear()
        return released

    @contextlib.contextmanager
    def cloning_for(self, owner: str) -> Iterator[None]:
        """Within the block, :meth:`clone` gives new sessions to ``owner``."""
        token = _clone_owner.set(owner)
        try:
            yield
        finally:
            _clone_owner.reset(token)

    def adopt(self, handle: str, position: int) -> None:
        """Record a handle this backend owns (e.g. a snapshot event) and its position."""
        with self._lock:
            self._positions[handle] = position

    # -- SessionBackend ------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def clone(self, handle: str, upto: int) -> str | None:
        new_owner = _clone_owner.get() or self.owner
        reply = self.call(self.stub.Clone, pb.CloneRequest(session=handle, upto=upto, new_owner=new_owner))
        if not reply.session:
            return None
        if new_owner == self.owner:
            self.adopt(reply.session, reply.position)
        return reply.session

    def close(self, handle: str) -> None:
        with self._lock:
            self._positions.pop(handle, None)
        if handle_instance(handle) != self.instance_id:
            return  # issued by an engine that is gone: nothing to release
        with contextlib.suppress(NotFound):
            self.call(self.stub.Close, pb.CloseRequest(session=handle))

    def position(self, handle: str) -> int:
        with self._lock:
            known = self._positions.get(handle)
        if known is not None:
            return known
        return self.call(self.stub.Describe, pb.DescribeRequest(session=handle)).position

    def valid(self, handle: str) -> bool:
        if not isinstance(handle, str) or handle_instance(handle) != self.instance_id:
            return False
        with self._lock:
            return handle in self._positions

    def held(self) -> int:
        """Handles this backend believes it holds."""
        with self._lock:
            return len(self._positions)
