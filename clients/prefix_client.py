"""PrefixClient: a typed Python client of the ``forkline.prefix.v1.PrefixCache`` service. A Lookup hit
is an engine session owned by this client's owner: continue it with an EngineClient of the same owner."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from clients.channel_client import ChannelClient
from clients.engine_client import GenerationStream, prompt_of
from engine_service.api.config import GenConfig
from engine_service.api.owners import DEFAULT_OWNER
from engine_service.serving.engine_wire import generation_config, prompt_fields
from engine_service.serving.errors import from_rpc_error
from protos import prefix_pb2 as pb
from protos import prefix_pb2_grpc

ROUTE_KEY_HEADER = "forkline-route-key"  # gRPC metadata key: the namespace a call belongs to
MISS_REASONS = {value: name.removeprefix("MISS_REASON_").lower() for name, value in pb.MissReason.items()}
INSERT_REFUSALS = {
    value: name.removeprefix("INSERT_REFUSAL_").lower() for name, value in pb.InsertRefusal.items()
}

EVENT_KINDS = {
    value: name.removeprefix("CACHE_EVENT_KIND_").lower() for name, value in pb.CacheEventKind.items()
}


@dataclass(frozen=True)
class CacheEvent:
    """One CacheEvents message (``protos/prefix.proto``): ``kind`` "stored" | "moved" (stored as a copy
    of engine ``source_engine``'s snapshot) | "evicted" | "cleared" | "dropped" | "gap" (``missed``
    events dropped) | "synced" (the replay is complete); ``namespace``: the entry's scope; ``digest``:
    its tokens' content digest (never the tokens)."""

    kind: str
    sequence: int
    engine: str
    engine_instance_id: str
    time: float
    namespace: str
    positions: int
    digest: bytes
    replayed: bool
    missed: int
    replica: str
    source_engine: str = ""


class CacheEventStream:
    """A running CacheEvents call: iterate for :class:`CacheEvent` values until the service ends the
    stream; ``cancel()`` ends it from here (the iteration then stops without an error)."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[CacheEvent]:
        try:
            for m in self._call:
                kind = EVENT_KINDS.get(m.kind, f"unknown_{m.kind}")
                yield CacheEvent(
                    kind,
                    m.sequence,
                    m.engine,
                    m.engine_instance_id,
                    m.time,
                    m.namespace,
                    m.positions,
                    m.digest,
                    m.replayed,
                    m.missed,
                    m.replica,
                    m.source_engine,
                )
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:
                raise from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


@dataclass(frozen=True)
class LookupResult:
    """session: a handle holding tokens[:reused] (None on a miss); reason: "unspecified" on a hit,
    else "empty" | "diverged" | "boundary_refused" | "window" | "engine_restarted" | "too_short" | "disabled"
    (``unknown_<n>`` for a reason this client does not know). engine: the engine holding ``session``
    (continue it with an EngineClient to that address); on a miss, the engine the service would
    route the prompt to."""

    session: str | None
    reused: int
    tokens: tuple[int, ...]
    reason: str
    diverged_at: int = 0
    engine: str = ""


@dataclass(frozen=True)
class InsertResult:
    """stored, or the reason it was not: "unspecified" when stored, else "content_mismatch" (the
    session does not hold these tokens) | "prepared_input" | "position_mismatch" | "duplicate" |
    "clone_refused" | "disabled" | "invalid_snapshot" | "evicted" | "over_budget" (``unknown_<n>``
    for a reason this client does not know)."""

    stored: bool
    reason: str


@dataclass(frozen=True)
class PrefixServiceStats:
    """The service's Stats answer: its cache's counters over every engine it routes to, and its own
    (``prefix_service.cache.outcomes.PrefixStats`` is one cache's)."""

    entries: int
    max_entries: int
    hits: int
    misses: int
    inserts: int
    dropped_on_restart: int
    engine_instance_id: str
    policy: str
    reused_positions: int
    refusals: dict[str, int] = field(default_factory=dict)  # inserts / clones turned down, by reason
    # the budget: max_entries above is the effective bound (min of --max_entries and the engine share)
    max_positions: int = 0
    positions: int = 0  # held by the entries now
    engine_share: float = 0.0
    pressure_evictions: int = 0  # entries evicted because a live request found the engine full
    pressure_retries: int = 0
    reclaimed: int = 0  # unknown handles under the service's owner released
    bytes_held: int = 0  # positions x the engine's bytes per position (0: not reported)
    max_bytes: int = 0  # max_positions x the same


class PrefixClient(ChannelClient):
    """``target`` is ``host:port`` or an open channel. Calls that name a namespace also send it as
    ``forkline-route-key`` metadata, for a proxy that keeps a namespace on one replica (clients/replicas.py)."""

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
        super().__init__(
            target,
            owner=owner,
            timeout=timeout,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        self.stub = prefix_pb2_grpc.PrefixCacheStub(self.channel)

    def lookup(
        self,
        tokens: Sequence[int] | None = None,
        *,
        text: str | None = None,
        namespace: str = "",
        chat: bool = False,
        system: str = "",
        add_special_tokens: bool = True,
        cache_salt: str = "",
    ) -> LookupResult:
        """``add_special_tokens``: plain text gets the model's own (BOS where it adds one, as Gemma's
        tokenizer does), as the gateway's Generate does by default: a stored prompt always starts at
        position 0. ``cache_salt``: matches only entries stored under the same salt."""
        fields = prompt_fields(prompt_of(tokens, text, chat, system, add_special_tokens))
        request = pb.LookupRequest(namespace=namespace, cache_salt=cache_salt, **fields)
        r = self._routed(self.stub.Lookup, request, namespace)
        reason = MISS_REASONS.get(r.reason, f"unknown_{r.reason}")  # a newer service's reason: no KeyError
        return LookupResult(r.session or None, r.reused, tuple(r.tokens), reason, r.diverged_at, r.engine)

    def insert(
        self,
        tokens: Sequence[int],
        session: str,
        *,
        namespace: str = "",
        metadata: Mapping[str, str] | None = None,
        engine: str = "",
        cache_salt: str = "",
    ) -> bool:
        """Store a snapshot of ``session`` under ``tokens``; True when stored (see :meth:`insert_detailed`)."""
        return self.insert_detailed(
            tokens, session, namespace=namespace, metadata=metadata, engine=engine, cache_salt=cache_salt
        ).stored

    def insert_detailed(
        self,
        tokens: Sequence[int],
        session: str,
        *,
        namespace: str = "",
        metadata: Mapping[str, str] | None = None,
        engine: str = "",
        cache_salt: str = "",
    ) -> InsertResult:
        """Like :meth:`insert`, and a refusal says why (the service stores only a session the engine
        confirms holds exactly ``tokens``). ``engine``: the engine holding ``session`` (as
        ``LookupResult.engine`` names it); required when the service routes to several engines."""
        request = pb.InsertRequest(
            namespace=namespace,
            tokens=list(tokens),
            session=session,
            metadata=dict(metadata or {}),
            engine=engine,
            cache_salt=cache_salt,
        )
        r = self._routed(self.stub.Insert, request, namespace)
        return InsertResult(r.stored, INSERT_REFUSALS.get(r.reason, f"unknown_{r.reason}"))

    def stats(self) -> PrefixServiceStats:
        s = self._unary(self.stub.Stats, pb.StatsRequest())
        return PrefixServiceStats(
            s.entries,
            s.max_entries,
            s.hits,
            s.misses,
            s.inserts,
            s.dropped_on_restart,
            s.engine_instance_id,
            s.policy,
            s.reused_positions,
            dict(s.refusals),
            s.max_positions,
            s.positions,
            s.engine_share,
            s.pressure_evictions,
            s.pressure_retries,
            s.reclaimed,
            s.bytes_held,
            s.max_bytes,
        )

    def clear(self) -> int:
        """Release the caller's entries (the admin owner's call: every entry); how many."""
        return self._unary(self.stub.Clear, pb.ClearRequest()).released

    def cache_events(self, *, replay: bool = False, timeout: float | None = None) -> CacheEventStream:
        """The service's cache events as they happen (this owner's namespaces; the admin's: all);
        ``replay``: first a "stored" event per entry already held, then "synced". ``timeout``: the
        call's deadline (None: the stream runs until cancelled or the service stops)."""
        call = self.stub.CacheEvents(
            pb.CacheEventsRequest(replay=replay), metadata=self._metadata, timeout=timeout
        )
        return CacheEventStream(call)

    def generate(
        self,
        tokens: Sequence[int] | None = None,
        *,
        text: str | None = None,
        chat: bool = False,
        system: str = "",
        namespace: str = "",
        config: GenConfig | None = None,
        ignore_eos: bool = False,
        skip_insert: bool = False,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,
        add_special_tokens: bool = True,
        cache_salt: str = "",
    ) -> GenerationStream:
        """Gateway generation: lookup -> engine Generate (prompt captured) -> insert, one stream, of
        ``config`` (default ``GenConfig()``). Plain ``text`` gets the tokenizer's special tokens (BOS
        where the model adds one) unless ``add_special_tokens`` is False; chat prompts get what the
        template writes."""
        request = pb.GatewayGenerateRequest(
            namespace=namespace,
            config=generation_config(config or GenConfig(), ignore_eos),
            skip_insert=skip_insert,
            metadata=dict(metadata or {}),
            cache_salt=cache_salt,
            **prompt_fields(prompt_of(tokens, text, chat, system, add_special_tokens)),
        )
        metadata = (*self._metadata, (ROUTE_KEY_HEADER, namespace))
        return GenerationStream(self.stub.Generate(request, metadata=metadata, timeout=timeout))

    def _routed(self, method, request, namespace: str):
        """A unary call that also carries the namespace as the route key (see the class docstring)."""

        def call(req, *, metadata, timeout):
            return method(req, metadata=(*metadata, (ROUTE_KEY_HEADER, namespace)), timeout=timeout)

        return self._unary(call, request)
