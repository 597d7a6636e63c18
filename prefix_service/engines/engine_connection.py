"""EngineConnection: one engine's stub as every part of the remote backend calls it, what the service
knows of that engine (instance, fingerprint, window) and the handles it holds there."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from engine_service.api.cache_kinds import clone_shared_share
from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo
from engine_service.api.owners import PERSISTENT_OWNER
from engine_service.serving.auth import ClientSecurity, on_behalf_of
from engine_service.serving.engine_wire import engine_info
from engine_service.serving.errors import from_rpc_error
from prefix_service.engines.engine_watch import EngineWatch, call_timeout, outage_of
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc

PROBE_TIMEOUT_S = 1.0  # an engine that answers at all answers Info within this

Reply = TypeVar("Reply", bound=Message)


class EngineConnection:
    """Calls as this service's ``owner`` (its own token) or, ``as_caller``, as a call's caller (its
    forwarded credential); every call carries its call's deadline, capped by ``timeout``, and waits
    for a down engine first (``engine_watch.py``). Engine errors arrive as forkline errors."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        owner: str = PERSISTENT_OWNER,
        timeout: float = 60.0,
        token: str | None = None,
    ) -> None:
        self.stub = engine_pb2_grpc.EngineStub(channel)
        self.owner, self.timeout = owner, timeout
        self.metadata = ClientSecurity(token=token).metadata(owner)
        self.watch: EngineWatch | None = None  # the engine's health, when watched
        self.address = ""
        self.instance_id = ""
        self.fingerprint = ""
        self.max_rewind: int | None = None  # session_backend.max_rewind, from Info's window geometry
        self.clone_shared_share = 0.0  # session_backend.clone_shared_share, from Info
        self.clone_shared_ring_positions = 0  # below it every layer is shared (Info's limits)
        self._lock = threading.Lock()
        self._positions: dict[str, int] = {}  # the handles this owner holds, as adopted
        self._digests: dict[str, bytes | None] = {}  # what the engine said each adopted handle holds

    def call(
        self,
        method: Callable[..., Reply],
        request: Message,
        call: CallContext | None = None,
        *,
        as_caller: bool = False,
        release: bool = False,
    ) -> Reply:
        """A unary call made for ``call`` (None: none; no deadline). ``release``: a Close cleaning up
        after a caller runs on the backend's own timeout and never waits for a down engine."""
        metadata = on_behalf_of(call) if as_caller and call is not None else self.metadata
        options = {"timeout": self.timeout} if release else self.call_options(self.timeout, call)
        try:
            return method(request, metadata=metadata, **options)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def call_options(self, cap: float | None, call: CallContext | None = None) -> dict[str, Any]:
        """``timeout`` (``call``'s time left, at most ``cap``) and ``wait_for_ready``, after waiting
        for a down engine (Unavailable when it stays down)."""
        timeout = call_timeout(cap, call)
        if self.watch is not None:
            self.watch.await_serving(timeout, outage_of(call))
        # a call nothing bounds does not wait for a connection (the watch just saw the engine SERVING)
        return {"timeout": timeout, "wait_for_ready": timeout is not None}

    def info(self, call: CallContext | None = None) -> EngineInfo:
        return engine_info(self.call(self.stub.Info, pb.InfoRequest(), call))

    def model(self) -> str:
        """The model the engine serves (its path)."""
        return self.call(self.stub.Info, pb.InfoRequest()).model

    def probe(self, timeout: float = PROBE_TIMEOUT_S) -> EngineInfo | None:
        """The engine's Info now, not waiting for a down engine (None: no answer); a draining engine answers."""
        try:
            return engine_info(self.stub.Info(pb.InfoRequest(), metadata=self.metadata, timeout=timeout))
        except grpc.RpcError:
            return None

    def refresh(self, info: EngineInfo | None = None) -> EngineInfo:
        """Adopt the engine's instance id, fingerprint and window from ``info`` (None: read Info now);
        a new instance forgets every handle of the old one."""
        info = info if info is not None else self.info()
        with self._lock:
            if info.instance_id != self.instance_id:
                self._forget_all()
            self.instance_id = info.instance_id
            self.fingerprint = info.fingerprint
            self.max_rewind = info.max_rewind
            self.clone_shared_share = clone_shared_share(
                info.cache_kind, info.kv_bytes_per_position, info.clone_shared_bytes_per_position
            )
            self.clone_shared_ring_positions = info.clone_shared_ring_positions
        return info

    # -- the handles this owner holds ----------------------------------------------------------------
    def adopt(self, handle: str, position: int, content_digest: bytes | None = None) -> None:
        """Record a handle this owner holds, its position and the digest the engine reported for it."""
        with self._lock:
            self._positions[handle] = position
            self._digests[handle] = content_digest

    def forget(self, handle: str | None = None) -> None:
        """Forget ``handle`` (None: every handle)."""
        with self._lock:
            if handle is None:
                self._forget_all()
            else:
                self._positions.pop(handle, None)
                self._digests.pop(handle, None)

    def known_position(self, handle: str) -> int | None:
        with self._lock:
            return self._positions.get(handle)

    def known_digest(self, handle: str) -> tuple[bool, bytes | None]:
        """Whether ``handle`` was adopted, and the digest recorded for it."""
        with self._lock:
            return handle in self._digests, self._digests.get(handle)

    def held(self) -> list[str]:
        with self._lock:
            return list(self._positions)

    def _forget_all(self) -> None:
        self._positions.clear()
        self._digests.clear()
