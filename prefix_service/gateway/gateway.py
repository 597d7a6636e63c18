"""Gateway: the prefix service's flows over one engine (lookup, insert, generate) and the only door to
that engine's cache, calls and snapshot files; no gRPC. Errors are ``engine_service.api.errors``."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial

from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import Cancelled, InvalidArgument, ResourceExhausted
from engine_service.api.limits import check_fits, check_nonempty, check_tokens
from engine_service.api.prompts import TextPrompt, Tokenized
from engine_service.api.stream_events import Snapshot
from prefix_service.cache.budget import DEFAULT_ENGINE_SHARE
from prefix_service.cache.checkpoints import CheckpointPlan, SnapshotRoom
from prefix_service.cache.events import EntryChange
from prefix_service.cache.index import token_key
from prefix_service.cache.outcomes import InsertOutcome, LookupOutcome, MissReason
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import Entry
from prefix_service.gateway.calls import GatewayRequest, GatewayStats, Prompt, PromptLookup
from prefix_service.gateway.checkpoint_cadence import CheckpointCadence
from prefix_service.gateway.gateway_backend import GatewayBackend
from prefix_service.gateway.generation_start import start_generation
from prefix_service.gateway.inflight import InflightPrefills, JoinConfig
from prefix_service.gateway.insert_flow import InsertFlow
from prefix_service.gateway.pressure import EnginePressure
from prefix_service.gateway.stream import GatewayStream
from prefix_service.tier.persistent_tier import PersistentTier, Restored
from prefix_service.tier.snapshot_store import extra_for

log = logging.getLogger(__name__)

# Misses an engine restart explains better (a too-short request or a refused clone says more).
_RESTART_MASKS = (MissReason.DISABLED, MissReason.EMPTY, MissReason.DIVERGED)


class Gateway:
    """``cache`` holds ``backend.sessions``'s handles; its bounds as given are the configured ones,
    capped by ``engine_share`` of the engine and ``max_cache_mib`` (0: the share only). ``tier``: the
    snapshot directory every engine's gateway shares. ``pressure_retry`` False: never evict and retry for
    a live request (tests' control). ``cache_generated``: a generation also stores its session at its
    last committed token; ``checkpoint_every`` N: every N generated tokens too (docs/RESUME.md)."""

    def __init__(
        self,
        cache: PrefixCache,
        backend: GatewayBackend,
        policy_name: str = "",
        *,
        engine_share: float = DEFAULT_ENGINE_SHARE,
        pressure_retry: bool = True,
        tier: PersistentTier | None = None,
        checkpoints: CheckpointPlan | None = None,
        max_cache_mib: int = 0,
        cache_generated: bool = True,
        checkpoint_every: int = 0,
        joins: JoinConfig | None = None,
    ) -> None:
        if cache.backend is not backend.sessions:
            raise InvalidArgument("cache must hold the given backend's sessions")
        self.cache, self.backend, self.policy_name, self.tier = cache, backend, policy_name, tier
        self.pressure = EnginePressure(cache, backend, engine_share, pressure_retry, max_cache_mib)
        self.flow = InsertFlow(cache, backend, self.pressure, tier)
        self.checkpoints = checkpoints if checkpoints is not None else CheckpointPlan()
        self.cache_generated = cache_generated  # a generation's end is stored too (prompt + answer)
        self.cadence = CheckpointCadence(checkpoint_every, tier is not None)  # decode checkpoints
        self.inflight = InflightPrefills(joins, cache.reusable)  # prompt prefills in flight, per scope
        self.dropped_on_restart = 0
        self.last_info: EngineInfo | None = None  # the engine's Info as check_engine last read it
        self._lock = threading.Lock()
        self._misses: Counter[str] = Counter()  # lookup misses by the reason reported (under _lock)

    # -- the engine ------------------------------------------------------------------------------
    def check_engine(self) -> EngineInfo:
        """Read the engine's Info and adopt it: the limits, the budget, and on a new instance id every
        entry dropped (the pool runs it about once a second, the health watch when the engine serves
        again; requests read :attr:`engine`)."""
        info = self.backend.info()  # outside the lock: the watch's own check needs it meanwhile
        with self._lock:
            previous = self.backend.instance_id
            self.backend.refresh(info)
            self.last_info = info
            self.pressure.apply_budget(info)
            if info.instance_id == previous:
                return info
            if previous:
                dropped = self.cache.clear()
                self.dropped_on_restart += dropped
                self.flow.restarted = True
                log.warning(
                    "engine restarted (%s -> %s): dropped %d entries", previous, info.instance_id, dropped
                )
            self.preload()
            return info

    @property
    def engine(self) -> EngineInfo:
        """The engine's Info as :meth:`check_engine` last read it (read now if it never was)."""
        info = self.last_info
        return info if info is not None else self.check_engine()

    @property
    def instance_id(self) -> str:
        return self.backend.instance_id

    @property
    def fingerprint(self) -> str:
        return self.cache.backend.fingerprint

    def serving(self, call: CallContext | None = None) -> EngineInfo:
        """Wait while the engine is down (Unavailable past what ``call`` may wait); its Info as last read."""
        self.backend.await_serving(call)
        return self.engine

    def preload(self) -> None:
        """Restore the snapshot directory's most recent entries in the background (``--snapshot_preload``)."""
        if self.tier is not None:
            files = self.backend.snapshot_files()
            self.tier.preload_in_background(self.cache, files=files, store=self._restored)

    # -- the calls -------------------------------------------------------------------------------
    def lookup(
        self,
        namespace: str,
        prompt: Prompt,
        call: CallContext,
        caller_active: Callable[[], bool] = lambda: True,
    ) -> PromptLookup:
        """Clone the best stored snapshot of ``prompt`` for ``call``'s owner; closed again, and Cancelled
        raised, when ``caller_active()`` is False by then."""
        self.serving(call)
        tokens = list(self.tokenized(prompt, call).ids)
        outcome = self.find(namespace, tokens, call)
        if (
            outcome.reason is MissReason.BOUNDARY_REFUSED
            and self.pressure.engine_full(call)
            and self.pressure.relieve()
        ):
            outcome = self.find(namespace, tokens, call)  # the clone may have been refused for room
        if outcome.match is not None and not caller_active():  # the caller left: nobody gets the clone
            self.backend.close_as(outcome.match.session, call)
            raise Cancelled("the caller left before the lookup completed")
        return PromptLookup(tuple(tokens), outcome)

    def insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        session: str,
        metadata: Mapping[str, str],
        call: CallContext,
    ) -> InsertOutcome:
        """Store a clone of ``call``'s ``session`` if it holds exactly ``tokens`` (``InsertFlow.hand_over``)."""
        self.serving(call)
        if not tokens:
            raise InvalidArgument("tokens must not be empty")
        self.checked(tokens, "tokens")
        return self.flow.hand_over(namespace, tokens, session, metadata, call)

    def generate(self, request: GatewayRequest, call: CallContext) -> GatewayStream:
        """Look up, start the engine Generate as the caller (capturing the prompt's snapshots for the
        service) and return its stream once started; a full engine: evict one entry, retry once."""
        most = self.serving(call).max_session_tokens
        tokenized = self.tokenized(request.prompt, call, self.message_ends_wanted, request.message_ends)
        tokens = list(tokenized.ids)
        check_nonempty(len(tokens))
        if most:  # what the engine would refuse is refused before the lookup clones (and counts a hit)
            check_fits(0, len(tokens), most)
        try:
            return start_generation(self, request, tokens, tokenized.message_ends, call)
        except ResourceExhausted as exc:
            if not self.pressure.relieve(exc):
                raise
        return start_generation(self, request, tokens, tokenized.message_ends, call)

    def stats(self, where: Callable[[str], bool] | None = None) -> GatewayStats:
        """The gateway's stats; with ``where`` (a caller's own namespaces) only its entries'."""
        mine = GatewayStats(
            cache=self.cache.stats(where).in_bytes(self.pressure.bytes_per_position),
            dropped_on_restart=0,
            engine_instance_id=self.instance_id,
            policy=self.policy_name or type(self.cache.policy).__name__,
            engine_share=self.pressure.engine_share,
        )
        if where is not None:
            return mine
        with self._lock:
            misses = dict(self._misses)
        return replace(
            mine,
            dropped_on_restart=self.dropped_on_restart,
            pressure_evictions=self.pressure.pressure_evictions,
            pressure_retries=self.pressure.pressure_retries,
            reclaimed=self.pressure.reclaimed,
            misses_by_reason=misses,
            joins=self.inflight.stats(),
        )

    def clear(self, where: Callable[[str], bool] | None = None) -> int:
        """Release every stored snapshot (or those of the namespaces ``where`` accepts); how many."""
        return self.cache.clear(where)

    # -- what the fleet, its moves and the doors read ----------------------------------------------
    def __len__(self) -> int:
        return len(self.cache)

    @property
    def positions(self) -> int:
        return self.cache.positions

    def fill(self) -> float:
        return self.cache.fill()

    def reusable(self, namespace: str, key: tuple[int, ...]) -> int:
        """Positions a lookup of ``key`` would reuse here (``PrefixCache.reusable``: no clone, no count)."""
        return self.cache.reusable(namespace, key)

    def reusable_entry(self, namespace: str, key: tuple[int, ...]) -> tuple[Entry, int] | None:
        return self.cache.reusable_entry(namespace, key)  # what a move exports

    def from_directory(self, namespace: str, key: tuple[int, ...]) -> int:
        """Positions of ``key`` the snapshot directory would give this engine (0: none)."""
        if self.tier is None or not self.has_files:
            return 0
        return self.tier.reusable(self.cache.backend, namespace, key)

    @property
    def message_ends_wanted(self) -> int:
        """How many message ends a chat prompt's checkpoints can use here (0: the window never evicts)."""
        return self.checkpoint_plan().message_ends(self.engine.window.evicts)

    def checkpoint_plan(self) -> CheckpointPlan:
        return self.checkpoints.for_cache(self.cache.max_entries)

    def listen(self, listener: Callable[[EntryChange], None] | None) -> None:
        self.cache.listen(listener)  # an EventHub follows the gateway (``cache/events.py``)

    def entries(self, namespace: str | None = None) -> list[Entry]:
        return self.cache.entries(namespace)

    # -- moves and restores (``fleet/moves.py``) ------------------------------------------------------
    @property
    def has_files(self) -> bool:  # its engine exports and imports snapshot files
        return self.backend.snapshot_files() is not None

    def export(self, namespace: str, entry: Entry, tokens: tuple[int, ...]) -> Iterator[bytes] | None:
        """``entry``'s file (all of it, or its first ``len(tokens)`` positions); None: refused."""
        files = self.backend.snapshot_files()
        if files is None:
            return None
        upto = None if len(tokens) >= entry.key_length else len(tokens)
        return files.export_session(entry.snapshot, extra_for(namespace, tokens, entry.metadata), upto)

    def accept_move(
        self,
        namespace: str,
        tokens: tuple[int, ...],
        metadata: Mapping[str, str],
        export: Callable[[], Iterator[bytes] | None],
        source: str,
    ) -> str:
        """Store a copy of engine ``source``'s snapshot of ``tokens`` (``InsertFlow.accept_move``)."""
        return self.flow.accept_move(namespace, tokens, metadata, export, source)

    def restore(
        self,
        namespace: str,
        key: tuple[int, ...],
        done: Restored | None = None,
        call: CallContext | None = None,
    ) -> bool:
        """Restore the snapshot directory's longest prefix of ``key`` when it beats the cache's."""
        if self.tier is None:
            return False
        files = self.backend.snapshot_files(call)
        return self.tier.restore(self.cache, namespace, key, done, files=files, store=self._restored)

    # -- the flows' steps (``generation_start.py``, the stream) ---------------------------------------
    def tokenized(
        self, prompt: Prompt, call: CallContext, wanted_ends: int = 0, message_ends: Sequence[int] = ()
    ) -> Tokenized:
        """Text tokenized by the engine with up to ``wanted_ends`` message ends (one engine call), or
        token ids checked against the vocabulary and given their ``message_ends``."""
        if isinstance(prompt, TextPrompt):
            return self.backend.tokenize(prompt, call, wanted_ends)
        return Tokenized(tuple(self.checked(prompt, "tokens")), tuple(message_ends))

    def detokenize(self, ids: Sequence[int], call: CallContext) -> str:
        """The engine's text of ``ids`` (checked against the vocabulary, InvalidArgument naming ``tokens``)."""
        self.serving(call)
        return self.backend.detokenize(self.checked(ids, "tokens"), call)

    def checked(self, ids: Sequence[int], field_name: str) -> list[int]:
        """Token ids inside the engine's vocabulary (InvalidArgument naming ``field_name`` otherwise)."""
        vocab = self.engine.vocab_size
        return check_tokens(ids, vocab, field_name) if vocab else list(ids)  # 0: not yet known

    def find(
        self, namespace: str, tokens: Sequence[int], call: CallContext, *, count: bool = True
    ) -> LookupOutcome:
        """The lookup itself: the directory's longer prefix restored first, the clone ``call``'s."""
        self.restore(namespace, token_key(tokens), call=call)
        clone = partial(self.backend.clone_for, call=call)
        outcome = self.cache.lookup(namespace, tokens, count=count, clone=clone)
        if self.flow.restarted and outcome.reason in _RESTART_MASKS:
            outcome = LookupOutcome.miss(MissReason.ENGINE_RESTARTED)
        if count and outcome.reason is not None:
            with self._lock:
                self._misses[str(outcome.reason)] += 1
        return outcome

    def store_snapshot(
        self, snapshot: Snapshot, request: GatewayRequest, tokens: Sequence[int], room: SnapshotRoom
    ) -> None:
        self.flow.capture(snapshot, request, tokens, room)  # a generation's snapshot event

    def written(self, request: GatewayRequest, tokens: Sequence[int]) -> bool:
        tier = self.tier
        return tier is not None and tier.store.holds(self.fingerprint, request.namespace, tokens)

    def close_session(self, session: str, call: CallContext) -> bool:
        """Close ``call``'s session (a gateway call's); False when the engine could not be told."""
        try:
            self.backend.close_as(session, call)
        except Exception:  # noqa: BLE001 - e.g. the service stopped and closed its channel;
            # its next start releases what this owner left in the engine
            log.debug("could not close gateway session %s", session, exc_info=True)
            return False
        return True

    def _restored(
        self, namespace: str, tokens: Sequence[int], handle: str, metadata: Mapping[str, str]
    ) -> InsertOutcome:
        return self.flow.store(namespace, tokens, handle, metadata, persist=False)
