"""PrefixServicer: ``forkline.prefix.v1.PrefixCache`` over a PrefixCache and a remote engine.

The service owns the :class:`PrefixCache` (and its retention policy); its snapshots are engine
handles held under the service's owner id. Before each operation it checks the engine's instance id
(one Info call): when the engine restarted, every entry is dropped (their handles are dead) and
lookups report MISS_REASON_ENGINE_RESTARTED until something is cached again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from engine_service.errors import Cancelled, InvalidArgument
from engine_service.rpc.convert import gen_config, owner_of, token_ids
from engine_service.rpc.errors import status_on_error
from prefix_service.prefix_cache import CLONE_REFUSED, PrefixCache
from prefix_service.rpc.engine_backend import EngineBackend
from protos import engine_pb2 as epb
from protos import prefix_pb2 as pb
from protos import prefix_pb2_grpc

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 10.0  # how long a gateway call whose client left waits for the engine stream to end


@dataclass
class PrefixDeps:
    """The cache and the engine backend it clones through (``cache.backend is backend``)."""

    cache: PrefixCache
    backend: EngineBackend
    policy_name: str = ""

    def __post_init__(self) -> None:
        if self.cache.backend is not self.backend:
            raise ValueError("cache must use the given backend")


class _StopOnce:
    """Calls ``stop(call, session)`` at most once, with the session known by then."""

    def __init__(self, stop, call, session: str) -> None:
        self._stop, self._call, self.session = stop, call, session
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._stop(self._call, self.session)


class PrefixServicer(prefix_pb2_grpc.PrefixCacheServicer):
    def __init__(self, deps: PrefixDeps) -> None:
        self.deps = deps
        self._lock = threading.Lock()
        self._restarted = False  # entries were dropped on an engine restart; nothing cached since
        self.dropped_on_restart = 0
        self._vocab_size = 0  # the engine's (Info, refreshed by check_engine): token ids are checked
        self._max_session_tokens = 0  # likewise: a gateway prompt must fit one engine session

    # -- helpers -------------------------------------------------------------------------------
    def check_engine(self) -> None:
        """Drop every entry when the engine's instance id changed (its handles are dead)."""
        backend = self.deps.backend
        with self._lock:
            previous = backend.instance_id
            info = backend.info()
            self._vocab_size = info.limits.vocab_size
            self._max_session_tokens = info.limits.max_session_tokens
            if info.instance_id == previous:
                return
            backend.refresh()
            if previous:
                dropped = self.deps.cache.clear()
                self.dropped_on_restart += dropped
                self._restarted = True
                log.warning("engine restarted (%s -> %s): dropped %d entries", previous, info.instance_id, dropped)

    def _tokens(self, request, owner: str) -> list[int]:
        which = request.WhichOneof("input")
        if which == "tokens":
            return self._checked(request.tokens.ids, "tokens")
        if which == "text":
            backend = self.deps.backend
            reply = backend.call(backend.stub.Tokenize, epb.TokenizeRequest(text=request.text), owner)
            return list(reply.ids)
        raise InvalidArgument("input is required: one of tokens, text")

    def _checked(self, ids: Sequence[int], field: str) -> list[int]:
        """Token ids inside the engine's vocabulary (InvalidArgument naming ``field`` otherwise)."""
        return token_ids(ids, self._vocab_size, field) if self._vocab_size else list(ids)

    def _miss_reason(self, namespace: str, tokens: Sequence[int], refused_before: int) -> tuple[int, int]:
        """(MissReason, diverged_at) for a lookup that returned nothing."""
        cache = self.deps.cache
        if len(tokens) < 2:
            return pb.MISS_REASON_TOO_SHORT, 0
        if cache.stats().refusals.get(CLONE_REFUSED, 0) > refused_before:
            return pb.MISS_REASON_BOUNDARY_REFUSED, 0
        if self._restarted:
            return pb.MISS_REASON_ENGINE_RESTARTED, 0
        if cache.max_entries == 0 or len(cache) == 0:
            return pb.MISS_REASON_DISABLED if cache.max_entries == 0 else pb.MISS_REASON_EMPTY, 0
        if cache.entries(namespace):
            return pb.MISS_REASON_DIVERGED, 0  # entries exist; none shares the first token
        return pb.MISS_REASON_EMPTY, 0

    def _lookup(self, namespace: str, tokens: Sequence[int], clone_owner: str):
        cache, backend = self.deps.cache, self.deps.backend
        refused_before = cache.stats().refusals.get(CLONE_REFUSED, 0)
        with backend.cloning_for(clone_owner):
            match = cache.lookup(namespace, tokens)
        if match is not None:
            return match, pb.MISS_REASON_UNSPECIFIED, match.reused
        reason, diverged = self._miss_reason(namespace, tokens, refused_before)
        return None, reason, diverged

    def _insert(self, namespace: str, tokens: Sequence[int], handle: str, metadata) -> bool:
        stored = self.deps.cache.insert(namespace, tokens, handle, dict(metadata))
        if stored:
            self._restarted = False
        return stored

    def _take_snapshot(self, snapshot: epb.SnapshotEvent, request: pb.GatewayGenerateRequest,
                       tokens: Sequence[int]) -> None:
        """Store a gateway call's prompt snapshot (the cache releases it when refused)."""
        if snapshot.handle:
            self.deps.backend.adopt(snapshot.handle, snapshot.position)
            self._insert(request.namespace, tokens, snapshot.handle, request.metadata)

    def _stop_generation(self, call, session: str) -> None:
        """End a gateway call's engine generation; its stream then ends on its own (see _drain)."""
        backend = self.deps.backend
        if session:
            try:
                backend.call(backend.stub.Close, epb.CloseRequest(session=session))
                return
            except Exception:  # noqa: BLE001 - e.g. the engine is gone: cancelling is all that is left
                log.debug("could not close gateway session %s", session, exc_info=True)
        call.cancel()

    def _drain(self, call, request: pb.GatewayGenerateRequest, tokens: Sequence[int]) -> None:
        """Read what is left of an engine stream so no snapshot handle it carries is lost; a stream
        that does not end within DRAIN_TIMEOUT_S is cancelled."""
        timer = threading.Timer(DRAIN_TIMEOUT_S, call.cancel)
        timer.daemon = True
        timer.start()
        try:
            for event in call:
                if event.WhichOneof("event") == "snapshot":
                    self._take_snapshot(event.snapshot, request, tokens)
        except grpc.RpcError:
            pass  # cancelled or failed: nothing more will arrive
        except Exception:  # noqa: BLE001 - cleanup must not mask the call's own outcome
            log.warning("could not drain a gateway engine stream", exc_info=True)
        finally:
            timer.cancel()
            call.cancel()

    # -- RPCs ----------------------------------------------------------------------------------
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        with status_on_error(context):
            owner = owner_of(context.invocation_metadata())
            self.check_engine()
            tokens = self._tokens(request, owner)
            match, reason, diverged = self._lookup(request.namespace, tokens, owner)
            if match is not None and not context.is_active():  # the caller left: nobody gets the clone
                backend = self.deps.backend
                backend.call(backend.stub.Close, epb.CloseRequest(session=match.session), owner)
                raise Cancelled("the caller left before the lookup completed")
            return pb.LookupResponse(
                session=match.session if match else "",
                reused=match.reused if match else 0,
                tokens=tokens,
                reason=reason,
                diverged_at=diverged,
            )

    def Insert(self, request: pb.InsertRequest, context: grpc.ServicerContext) -> pb.InsertResponse:
        with status_on_error(context):
            owner = owner_of(context.invocation_metadata())
            self.check_engine()
            backend = self.deps.backend
            if not request.tokens:
                raise InvalidArgument("tokens must not be empty")
            self._checked(request.tokens, "tokens")
            described = backend.call(backend.stub.Describe, epb.DescribeRequest(session=request.session), owner)
            if described.position != len(request.tokens) or self.deps.cache.max_entries == 0:
                return pb.InsertResponse(stored=False)  # refused without cloning
            # The caller keeps its session; the service stores its own clone of it.
            with backend.cloning_for(backend.owner):
                reply = backend.call(
                    backend.stub.Clone,
                    epb.CloneRequest(session=request.session, upto=len(request.tokens), new_owner=backend.owner),
                    owner,
                )
            if not reply.session:
                return pb.InsertResponse(stored=False)
            backend.adopt(reply.session, reply.position)
            stored = self._insert(request.namespace, list(request.tokens), reply.session, request.metadata)
            return pb.InsertResponse(stored=stored)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with status_on_error(context):
            s = self.deps.cache.stats()
            return pb.StatsResponse(
                entries=s.entries,
                max_entries=s.max_entries,
                hits=s.hits,
                misses=s.misses,
                inserts=s.inserts,
                dropped_on_restart=self.dropped_on_restart,
                engine_instance_id=self.deps.backend.instance_id,
                policy=self.deps.policy_name or type(self.deps.cache.policy).__name__,
                reused_positions=s.reused_tokens,
            )

    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearResponse:
        with status_on_error(context):
            return pb.ClearResponse(released=self.deps.cache.clear())

    def Generate(
        self, request: pb.GatewayGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[epb.GenerateEvent]:
        with status_on_error(context):
            owner = owner_of(context.invocation_metadata())
            self.check_engine()
            backend = self.deps.backend
            tokens = self._tokens(request, owner)
            if not tokens:
                raise InvalidArgument("input is empty")
            # What the engine would refuse is refused before the lookup clones (and counts a hit).
            gen_config(request.config, ())
            if self._max_session_tokens and len(tokens) > self._max_session_tokens:
                raise InvalidArgument(f"input of {len(tokens)} positions exceeds the engine's "
                                      f"max_session_tokens={self._max_session_tokens}")
            match, _, _ = self._lookup(request.namespace, tokens, backend.owner)
            reused = match.reused if match else 0
            engine_request = epb.GenerateRequest(
                session=match.session if match else "",
                tokens=epb.TokenIds(ids=tokens[reused:]),
                config=request.config,
                # a disabled cache would only release the snapshot: do not clone it at all
                capture=epb.CaptureOptions(prompt_snapshot=not request.skip_insert and self.deps.cache.max_entries > 0),
            )
            call = backend.stub.Generate(engine_request, metadata=backend.metadata)
            # The client went away: end the engine generation by closing its session (the match, or
            # the fresh one `started` names), not by cancelling the engine call, so that snapshot
            # events the engine already sent are still read (and stored or released), not lost.
            stop = _StopOnce(self._stop_generation, call, match.session if match else "")
            context.add_callback(stop)
            ended = False
            try:
                for event in call:
                    which = event.WhichOneof("event")
                    if which == "snapshot":
                        self._take_snapshot(event.snapshot, request, tokens)
                        continue
                    if which == "started":
                        stop.session = stop.session or event.started.session
                        event.started.session = ""  # the service's session: not the caller's to use
                    yield event
                ended = True
            finally:
                if not ended:
                    stop()
                self._drain(call, request, tokens)
                if match is not None:
                    try:
                        backend.close(match.session)
                    except Exception:  # noqa: BLE001 - e.g. the service stopped and closed its channel;
                        # its next start releases what this owner left in the engine
                        log.debug("could not close gateway session %s", match.session, exc_info=True)
