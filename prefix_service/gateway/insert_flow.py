"""InsertFlow: the one way an entry enters a gateway's cache -- a caller's Insert, a generation's
snapshots, a move, a restore from the snapshot directory all end in :meth:`InsertFlow.store`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence

from engine_service.api.answers import CloneRefusal
from engine_service.api.call_context import CallContext
from engine_service.api.content import content_digest
from engine_service.api.errors import ForklineError, InvalidArgument
from engine_service.api.stream_events import Snapshot, SnapshotKind
from prefix_service.cache.budget import Reservation
from prefix_service.cache.checkpoints import SnapshotRoom
from prefix_service.cache.outcomes import QUOTA, InsertOutcome, InsertRefusal
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import BOUNDARY_KEY
from prefix_service.cache.session_backend import Handle, release_handle
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway_backend import GatewayBackend
from prefix_service.gateway.pressure import EnginePressure
from prefix_service.tier.persistent_tier import PersistentTier

log = logging.getLogger(__name__)

# Engine clone refusals an insert reports as such (any other: CLONE_REFUSED).
_CLONE_REFUSALS = {
    CloneRefusal.CONTENT_MISMATCH: InsertRefusal.CONTENT_MISMATCH,
    CloneRefusal.PREPARED_INPUT: InsertRefusal.PREPARED_INPUT,
    CloneRefusal.POSITION: InsertRefusal.POSITION_MISMATCH,
}


class InsertFlow:
    """``restarted``: the engine restarted (its entries dropped) and nothing was stored since: a miss
    is then reported as the restart's (the gateway sets it, every stored entry clears it)."""

    def __init__(
        self,
        cache: PrefixCache,
        backend: GatewayBackend,
        pressure: EnginePressure,
        tier: PersistentTier | None,
    ) -> None:
        self.cache, self.backend, self.pressure, self.tier = cache, backend, pressure, tier
        self.restarted = False

    def store(
        self,
        namespace: str,
        tokens: Sequence[int],
        handle: Handle,
        metadata: Mapping[str, str],
        *,
        digest: bytes | None = None,
        reservation: Reservation | None = None,
        moved_from: str = "",
        persist: bool = True,
    ) -> InsertOutcome:
        """Store ``handle`` under ``tokens`` (or release it); a stored entry is written to the snapshot
        directory when ``persist`` (not for checkpoints, copies and restores: the folder's restore
        picks the longest prefix, which those never add)."""
        outcome = self.cache.insert(
            namespace,
            tokens,
            handle,
            dict(metadata),
            digest=digest,
            reservation=reservation,
            moved_from=moved_from,
        )
        if outcome.stored:
            self.restarted = False
            if persist and self.tier is not None:
                self.tier.persist(
                    self.cache, namespace, tokens, handle, metadata, self.backend.snapshot_files()
                )
        return outcome

    def hand_over(
        self,
        namespace: str,
        tokens: Sequence[int],
        session: str,
        metadata: Mapping[str, str],
        call: CallContext,
    ) -> InsertOutcome:
        """Store the service's own clone of ``call``'s ``session`` if it holds exactly ``tokens``: a
        session at another position, or a disabled cache, is refused without cloning; room is reserved
        before the clone, which the engine makes only for that content."""
        described = self.backend.describe(session, call)
        if described.position != len(tokens):
            return self.refused(InsertRefusal.POSITION_MISMATCH)
        if self.cache.max_entries == 0:
            return self.refused(InsertRefusal.DISABLED)
        try:
            digest = content_digest(tokens)  # the one hash of this insert: the engine and the cache check it
        except InvalidArgument as exc:
            raise InvalidArgument(f"tokens: {exc}") from None
        if described.content_digest not in (None, digest):  # refused before any room is made for it
            return self.refused(InsertRefusal.CONTENT_MISMATCH)
        reservation = self.cache.reserve(namespace, tokens, metadata)
        if not isinstance(reservation, Reservation):
            return self.refused(reservation)
        try:
            taken = self.pressure.take_clone(session, len(tokens), call, digest)
        except BaseException:
            reservation.release()
            raise
        if taken is None or taken.handle is None:
            reservation.release()
            if taken is None:
                return self.refused(InsertRefusal.OVER_BUDGET)
            return self.refused(_CLONE_REFUSALS.get(taken.refusal, InsertRefusal.CLONE_REFUSED))
        unclaimed = self.claim(taken.handle, call)
        if unclaimed is not None:
            reservation.release()
            return self.refused(unclaimed)
        return self.store(namespace, tokens, taken.handle, metadata, digest=digest, reservation=reservation)

    def capture(
        self, snapshot: Snapshot, request: GatewayRequest, tokens: Sequence[int], room: SnapshotRoom
    ) -> None:
        """Store a generation's snapshot under ``tokens[:position]`` (``tokens``: the prompt and the ids
        streamed before it): a prompt snapshot or checkpoint in its reservation, a generated one in room
        reserved now. A snapshot the caller's quota refused is counted (QUOTA); nothing is reclaimed for
        it (other callers' captures on their way are among the handles the service does not know yet)."""
        reservation = room.take(snapshot.position) if snapshot.kind != SnapshotKind.GENERATED else None
        if not snapshot.handle:
            if reservation is not None:
                reservation.release()
            if snapshot.reason == CloneRefusal.QUOTA:  # the caller's quota: its hand-over counts there
                self.cache.record_refusal(QUOTA)
            return
        self.backend.adopt(snapshot.handle, snapshot.position, snapshot.content_digest)
        metadata, checkpoint = request.metadata, snapshot.kind == SnapshotKind.BREAKPOINT
        if snapshot.kind != SnapshotKind.PROMPT:
            metadata = {**metadata, BOUNDARY_KEY: snapshot.kind}
        key = tokens[: snapshot.position]
        if snapshot.kind == SnapshotKind.GENERATED:  # room first: its victims free the engine quota
            reservation = self._generated_room(request.namespace, key, snapshot.position, metadata)
            if reservation is None:
                release_handle(self.cache.backend, snapshot.handle)
                return
        unclaimed = self.claim(snapshot.handle)
        if unclaimed is not None:
            if reservation is not None:
                reservation.release()
            self.cache.record_refusal(unclaimed)
            return
        self.store(
            request.namespace, key, snapshot.handle, metadata, reservation=reservation, persist=not checkpoint
        )

    def _generated_room(
        self, namespace: str, key: Sequence[int], position: int, metadata: Mapping[str, str]
    ) -> Reservation | None:
        """Room for a generated snapshot, reserved as it arrives (its length is known only then; the
        policy's lower-ranked entries are evicted for it); None: refused (counted) or already stored."""
        if len(key) != position:  # the stream ended before the ids it holds: never stored unverified
            self.cache.record_refusal(InsertRefusal.POSITION_MISMATCH)
            return None
        reserved = self.cache.reserve(namespace, key, metadata)
        if isinstance(reserved, Reservation):
            return reserved
        if reserved is not InsertRefusal.DUPLICATE:  # a duplicate is refreshed: nothing to store
            self.cache.record_refusal(reserved)
        return None

    def accept_move(
        self,
        namespace: str,
        tokens: tuple[int, ...],
        metadata: Mapping[str, str],
        export: Callable[[], Iterator[bytes] | None],
        source: str,
    ) -> str:
        """Store a copy of engine ``source``'s snapshot of ``tokens``: room here first, then
        ``export()`` imported; "" when stored, else why not (``moves.MoveOutcome.refusal``). An
        engine's failure raises (the room released)."""
        room = self.cache.reserve(namespace, tokens, metadata)  # evicts what ranks below it first
        if not isinstance(room, Reservation):
            return f"insert:{room}"
        files = self.backend.snapshot_files()
        try:
            chunks = export()
            imported = None if chunks is None or files is None else files.import_session(chunks)
        except ForklineError:
            room.release()
            raise
        if imported is None or imported.handle is None:
            room.release()
            return "export" if imported is None else f"import:{imported.refusal}"
        outcome = self.store(
            namespace, tokens, imported.handle, metadata, reservation=room, moved_from=source, persist=False
        )
        return "" if outcome.stored else f"insert:{outcome.reason}"

    def claim(self, handle: str, call: CallContext | None = None) -> InsertRefusal | None:
        """Take over the quota charge of a caller's hand-over (``pressure.claim``); unclaimed: released."""
        refusal = self.pressure.claim(handle, call)
        if refusal is not None:
            release_handle(self.cache.backend, handle)
        return refusal

    def refused(self, reason: InsertRefusal) -> InsertOutcome:
        """An insert refused before the cache saw a snapshot (counted with the cache's refusals)."""
        self.cache.record_refusal(reason)
        return InsertOutcome(reason)
