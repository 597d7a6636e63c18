"""Gateway: the prefix service's flows over one engine as domain code (no gRPC), over a GatewayBackend.

It owns the engine's :class:`PrefixCache` (engine handles held under the backend's owner id).
:meth:`Gateway.check_engine` reads the engine's Info: the limits requests are checked against, the
budget (``pressure.py``), and a new instance id drops every entry (then misses say ENGINE_RESTARTED).

- ``lookup(namespace, prompt, owner)``: the prompt's tokens and a clone of the best snapshot, owned by
  ``owner`` (closed, and Cancelled raised, when the caller left meanwhile).
- ``insert(namespace, tokens, session, metadata, owner)``: store the service's own clone of the
  caller's session, made only if the engine confirms it holds exactly ``tokens``; room reserved first.
- ``generate(request, owner) -> GatewayStream``: lookup, then an engine Generate as the caller that
  continues the match and captures for the service the prompt snapshot (and checkpoints inside it,
  ``cache/checkpoints.py``), stored as they arrive; a full engine: evict one entry, retry once.
- With a tier (``tier/``) stored entries are also written to the snapshot directory, and a lookup
  first restores the directory's longer prefix of the prompt. Errors are ``engine_service.api.errors``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from engine_service.api.answers import CloneRefusal
from engine_service.api.content import content_digest
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import Cancelled, InvalidArgument, ResourceExhausted
from engine_service.api.limits import check_tokens
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Snapshot, SnapshotKind
from prefix_service.cache.budget import DEFAULT_ENGINE_SHARE, Reservation
from prefix_service.cache.checkpoints import CheckpointPlan, SnapshotRoom, checkpoint_positions, message_ends
from prefix_service.cache.index import token_key
from prefix_service.cache.outcomes import (
    QUOTA,
    InsertOutcome,
    InsertRefusal,
    LookupOutcome,
    Match,
    MissReason,
)
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import BOUNDARY_KEY
from prefix_service.cache.session_backend import release_handle
from prefix_service.gateway.calls import GatewayRequest, GatewayStats, Prompt, PromptLookup
from prefix_service.gateway.gateway_backend import EngineGenerate, EngineStream, GatewayBackend
from prefix_service.gateway.pressure import EnginePressure
from prefix_service.gateway.stream import GatewayStream
from prefix_service.tier.persistent_tier import PersistentTier

log = logging.getLogger(__name__)

# Engine clone refusals an insert reports as such (any other: CLONE_REFUSED).
_CLONE_REFUSALS = {
    CloneRefusal.CONTENT_MISMATCH: InsertRefusal.CONTENT_MISMATCH,
    CloneRefusal.PREPARED_INPUT: InsertRefusal.PREPARED_INPUT,
    CloneRefusal.POSITION: InsertRefusal.POSITION_MISMATCH,
}

# Misses an engine restart explains better (a too-short request or a refused clone says more).
_RESTART_MASKS = (MissReason.DISABLED, MissReason.EMPTY, MissReason.DIVERGED)


class Gateway:
    """See the module docstring. ``cache.backend`` must be ``backend``; the cache's bounds as given
    are the configured ones (``--max_entries``, ``--max_positions``), capped by ``engine_share`` of
    the engine. ``pressure_retry`` False: never evict and retry for a live request (a negative
    control for tests)."""

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
    ) -> None:
        if cache.backend is not backend:
            raise InvalidArgument("cache must use the given backend")
        self.cache = cache
        self.backend = backend
        self.policy_name = policy_name
        self.pressure = EnginePressure(cache, backend, engine_share, pressure_retry)
        self.dropped_on_restart = 0
        self._lock = threading.Lock()
        self._restarted = False  # entries were dropped on an engine restart; nothing cached since
        self.last_info: EngineInfo | None = None  # the engine's Info as check_engine last read it
        self.tier = tier  # the snapshot directory (--snapshot_dir), shared by every engine's gateway
        self._misses: Counter[str] = Counter()  # lookup misses by the reason reported (under _lock)
        self.checkpoints = checkpoints if checkpoints is not None else CheckpointPlan()

    # -- the engine ------------------------------------------------------------------------------
    def check_engine(self) -> EngineInfo:
        """Read the engine's Info (one call) and adopt it: the limits requests are checked against,
        the budget, and when its instance id changed, every entry dropped. Not per request: the
        engine pool runs it about once a second and the health watch whenever the engine serves
        again (``engines/``); a request reads :attr:`engine`. The call runs outside the gateway's lock
        (it may wait for a down engine while the health watch's own check needs the lock)."""
        backend = self.backend
        info = backend.info()
        with self._lock:
            previous = backend.instance_id
            backend.refresh(info)
            self.last_info = info
            self.pressure.apply_budget(info)
            if info.instance_id == previous:
                return info
            if previous:
                dropped = self.cache.clear()
                self.dropped_on_restart += dropped
                self._restarted = True
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

    def _serving(self) -> EngineInfo:
        """A request's first step: wait while the engine is down (Unavailable when it stays down, as
        the request's first engine call would; no call is made), then its Info as last read."""
        self.backend.await_serving()
        return self.engine

    def preload(self) -> None:
        """Restore the snapshot directory's most recent entries into this engine in the background
        (``--snapshot_preload``; nothing without a directory or with 0)."""
        if self.tier is not None:
            self.tier.preload_in_background(self.cache, on_loaded=self._restored_from_disk)

    def _restored_from_disk(self) -> None:
        self._restarted = False  # entries are back: misses are no longer the restart's

    def lookup(
        self, namespace: str, prompt: Prompt, owner: str, caller_active: Callable[[], bool] = lambda: True
    ) -> PromptLookup:
        """Clone the best stored snapshot of ``prompt`` for ``owner``, who owns the clone. When
        ``caller_active()`` is False after the lookup, the clone is closed and Cancelled raised."""
        self._serving()
        tokens = self._tokens(prompt, owner)
        outcome = self._lookup(namespace, tokens, owner)
        if (
            outcome.reason is MissReason.BOUNDARY_REFUSED
            and self.pressure.engine_full()
            and self.pressure.relieve()
        ):
            outcome = self._lookup(namespace, tokens, owner)  # the clone may have been refused for room
        if outcome.match is not None and not caller_active():  # the caller left: nobody gets the clone
            self.backend.close_as(outcome.match.session, owner)
            raise Cancelled("the caller left before the lookup completed")
        return PromptLookup(tuple(tokens), outcome)

    def insert(
        self, namespace: str, tokens: Sequence[int], session: str, metadata: Mapping[str, str], owner: str
    ) -> InsertOutcome:
        """Store a clone of ``owner``'s ``session`` if it holds exactly ``tokens`` (see the module
        docstring). A session at another position, or a disabled cache, is refused without cloning;
        one holding other content (or a prepared input) is refused by the engine's clone."""
        self._serving()
        if not tokens:
            raise InvalidArgument("tokens must not be empty")
        self._checked(tokens, "tokens")
        described = self.backend.describe(session, owner)
        if described.position != len(tokens):
            return self._refused(InsertRefusal.POSITION_MISMATCH)
        if self.cache.max_entries == 0:
            return self._refused(InsertRefusal.DISABLED)
        try:
            digest = content_digest(tokens)  # the one hash of this insert: the engine and the cache check it
        except InvalidArgument as exc:
            raise InvalidArgument(f"tokens: {exc}") from None
        if described.content_digest not in (None, digest):  # refused before any room is made for it
            return self._refused(InsertRefusal.CONTENT_MISMATCH)
        reservation = self.cache.reserve(namespace, tokens, metadata)  # room first: the clone fits the share
        if not isinstance(reservation, Reservation):
            return self._refused(reservation)
        try:
            taken = self.pressure.take_clone(session, len(tokens), owner, digest)
        except BaseException:
            reservation.release()
            raise
        if taken is None or taken.handle is None:
            reservation.release()
            if taken is None:
                return self._refused(InsertRefusal.OVER_BUDGET)
            return self._refused(_CLONE_REFUSALS.get(taken.refusal, InsertRefusal.CLONE_REFUSED))
        unclaimed = self._claim(taken.handle)
        if unclaimed is not None:
            reservation.release()
            return self._refused(unclaimed)
        return self._insert(namespace, tokens, taken.handle, metadata, digest, reservation)

    def generate(self, request: GatewayRequest, owner: str) -> GatewayStream:
        """Look up, start the engine generation and return its stream once the engine started it
        (see the module docstring; a full engine: evict one entry and retry once)."""
        most = self._serving().max_session_tokens
        tokens = self._tokens(request.prompt, owner)
        if not tokens:
            raise InvalidArgument("input is empty")
        # What the engine would refuse is refused before the lookup clones (and counts a hit).
        if most and len(tokens) > most:
            raise InvalidArgument(
                f"input of {len(tokens)} positions exceeds the engine's max_session_tokens={most}"
            )
        try:
            return self._start(request, tokens, owner)
        except ResourceExhausted as exc:
            if not self.pressure.relieve(exc):
                raise
        return self._start(request, tokens, owner)

    def stats(self, where: Callable[[str], bool] | None = None) -> GatewayStats:
        """The gateway's stats; with ``where`` (a caller's own namespaces, ``tenancy.py``) only its
        entries' (``PrefixCache.stats``) and none of the service's own counters."""
        mine = GatewayStats(
            cache=self.cache.stats(where),
            dropped_on_restart=0,
            engine_instance_id=self.backend.instance_id,
            policy=self.policy_name or type(self.cache.policy).__name__,
            engine_share=self.pressure.engine_share,
        )
        if where is not None:
            return mine
        return replace(
            mine,
            dropped_on_restart=self.dropped_on_restart,
            pressure_evictions=self.pressure.pressure_evictions,
            pressure_retries=self.pressure.pressure_retries,
            reclaimed=self.pressure.reclaimed,
            misses_by_reason=self._miss_counts(),
        )

    def _miss_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._misses)

    def clear(self, where: Callable[[str], bool] | None = None) -> int:
        """Release every stored snapshot (or those of the namespaces ``where`` accepts); how many."""
        return self.cache.clear(where)

    # -- internals -------------------------------------------------------------------------------
    def _start(self, request: GatewayRequest, tokens: list[int], owner: str) -> GatewayStream:
        """One attempt of :meth:`generate`: reserve room for the prompt snapshot, look up (the clone
        is the caller's), reserve room for the checkpoints past the match (``checkpoints.py``),
        start the engine Generate as the caller and read its first event (where the engine's
        refusal, e.g. RESOURCE_EXHAUSTED, arrives)."""
        # a disabled cache would only release the snapshot: do not clone it at all
        room = SnapshotRoom()
        capture = request.store_prompt and self.cache.max_entries > 0
        if capture:
            reserved = self.cache.reserve(request.namespace, tokens, request.metadata)
            if isinstance(reserved, Reservation):
                room.add(len(tokens), reserved)
            else:  # no room the policy would give it: no prompt snapshot
                self.cache.record_refusal(reserved)
        match: Match | None = None
        stream: EngineStream | None = None
        try:
            match = self._lookup(request.namespace, tokens, owner, count=request.count_lookup).match
            reused = match.reused if match else 0
            config = request.config
            if capture:
                breakpoints = self._reserve_checkpoints(request, tokens, reused, owner, room)
                if breakpoints:
                    config = replace(config, prefill_breakpoints=breakpoints)
            stream = self.backend.generate(
                EngineGenerate(
                    session=match.session if match else "",
                    tokens=tuple(tokens[reused:]),
                    config=config,
                    ignore_eos=request.ignore_eos,
                    prompt_snapshot=room.holds(len(tokens)),
                    owner=owner,
                    close_session=match is not None,  # the match is the call's: the engine closes it
                )
            )
            first = next(stream, None)
        except BaseException:
            room.release()
            if stream is not None:
                stream.cancel()
            if match is not None:
                self.close_session(match.session, owner)
            raise
        return GatewayStream(self, stream, request, tokens, match, owner, first, room)

    def _reserve_checkpoints(
        self, request: GatewayRequest, tokens: Sequence[int], reused: int, owner: str, room: SnapshotRoom
    ) -> tuple[int, ...]:
        """The breakpoints to ask the engine for (``checkpoints.py``): only on an engine whose cache
        evicts window rows, past ``reused``, fewer than half the cache's entries, each with room
        reserved (a checkpoint the policy gives no room, or one already stored, is not asked for)."""
        if not self.checkpoints.enabled or not self.engine.window.evicts:
            return ()
        # one prompt's snapshots take at most half the cache's entries: a long prompt never flushes it
        plan = self.checkpoints.limited(self.cache.max_entries // 2 - 1)
        if not plan.enabled or len(tokens) - reused < 2:
            return ()  # nothing lies strictly between the match and the prompt end: no Tokenize either
        text = request.prompt if isinstance(request.prompt, TextPrompt) else request.source
        ends = (
            message_ends(text, tokens, reused, lambda part: self.backend.tokenize(part, owner))
            if text
            else []
        )
        wanted = []
        metadata = {**request.metadata, BOUNDARY_KEY: SnapshotKind.BREAKPOINT}
        for position in checkpoint_positions(plan, len(tokens), reused, ends):
            reserved = self.cache.reserve(request.namespace, tokens[:position], metadata)
            if isinstance(reserved, Reservation):
                room.add(position, reserved)
                wanted.append(position)
            elif reserved is not InsertRefusal.DUPLICATE:
                self.cache.record_refusal(reserved)
        return tuple(wanted)

    def _tokens(self, prompt: Prompt, owner: str) -> list[int]:
        if isinstance(prompt, TextPrompt):
            return self.backend.tokenize(prompt, owner)
        return self._checked(prompt, "tokens")

    def _checked(self, ids: Sequence[int], field_name: str) -> list[int]:
        """Token ids inside the engine's vocabulary (InvalidArgument naming ``field_name`` otherwise)."""
        vocab = self.engine.vocab_size
        return check_tokens(ids, vocab, field_name) if vocab else list(ids)  # 0: not yet known

    def _lookup(
        self, namespace: str, tokens: Sequence[int], clone_owner: str, *, count: bool = True
    ) -> LookupOutcome:
        if self.tier is not None and self.tier.restore(self.cache, namespace, token_key(tokens)):
            self._restarted = False  # served from disk: not a restart miss
        with self.backend.cloning_for(clone_owner):
            outcome = self.cache.lookup(namespace, tokens, count=count)
        if self._restarted and outcome.reason in _RESTART_MASKS:
            outcome = LookupOutcome.miss(MissReason.ENGINE_RESTARTED)
        if count and outcome.reason is not None:
            with self._lock:
                self._misses[str(outcome.reason)] += 1
        return outcome

    def _insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        handle: str,
        metadata: Mapping[str, str],
        digest: bytes | None = None,
        reservation: Reservation | None = None,
        *,
        persist: bool = True,
    ) -> InsertOutcome:
        """Store ``handle`` under ``tokens``; a stored entry is also written to the snapshot directory
        unless ``persist`` is False (checkpoints stay in memory: a file's restore picks the longest
        common prefix, which a checkpoint never is when a fuller snapshot exists)."""
        outcome = self.cache.insert(
            namespace, tokens, handle, dict(metadata), digest=digest, reservation=reservation
        )
        if outcome.stored:
            self._restarted = False
            if self.tier is not None and persist:
                self.tier.persist(self.cache, namespace, tokens, handle, metadata)
        return outcome

    def _claim(self, handle: str) -> InsertRefusal | None:
        """Take over the engine quota charge of a caller's hand-over before it is stored (it counted
        against the caller until now: ``pressure.claim``); a handle that cannot be claimed is released."""
        refusal = self.pressure.claim(handle)
        if refusal is not None:
            release_handle(self.backend, handle)
        return refusal

    def _refused(self, reason: InsertRefusal) -> InsertOutcome:
        """An insert refused before the cache saw a snapshot (counted with the cache's refusals)."""
        self.cache.record_refusal(reason)
        return InsertOutcome(reason)

    # -- the stream's host (stream.StreamHost) --------------------------------------------------------
    def store_snapshot(
        self, snapshot: Snapshot, request: GatewayRequest, tokens: Sequence[int], room: SnapshotRoom
    ) -> None:
        """Store a gateway call's prompt snapshot or checkpoint (``tokens[:position]``, metadata
        ``boundary="breakpoint"``) in its reservation: the cache verifies the content the engine
        reported for it against those tokens (and releases it when refused). A snapshot refused for
        QUOTA was refused for the caller's quota (a capture counts against its giver until claimed):
        it is counted, and nothing of the service's is reclaimed -- the handles the service does not
        know yet include other callers' captures on their way."""
        reservation = room.take(snapshot.position)
        if snapshot.handle:
            self.backend.adopt(snapshot.handle, snapshot.position, snapshot.content_digest)
            unclaimed = self._claim(snapshot.handle)
            if unclaimed is not None:
                if reservation is not None:
                    reservation.release()
                self.cache.record_refusal(unclaimed)
                return
            metadata, checkpoint = request.metadata, snapshot.kind == SnapshotKind.BREAKPOINT
            if checkpoint:
                metadata = {**metadata, BOUNDARY_KEY: SnapshotKind.BREAKPOINT}
            self._insert(
                request.namespace,
                tokens[: snapshot.position],
                snapshot.handle,
                metadata,
                reservation=reservation,
                persist=not checkpoint,
            )
            return
        if reservation is not None:
            reservation.release()
        if snapshot.reason == CloneRefusal.QUOTA:  # the caller's quota: its hand-over counts there
            self.cache.record_refusal(QUOTA)

    def close_session(self, session: str, owner: str) -> bool:
        """Close ``owner``'s session (a gateway call's); False when the engine could not be told."""
        try:
            self.backend.close_as(session, owner)
        except Exception:  # noqa: BLE001 - e.g. the service stopped and closed its channel;
            # its next start releases what this owner left in the engine
            log.debug("could not close gateway session %s", session, exc_info=True)
            return False
        return True
