"""EnginePressure: the gateway's cache within its share of the engine and its byte bound
(``apply_budget``), and what it
does when a live request finds the engine full (``relieve``: evict one entry, retry once) or the
service's own quota full (``reclaim`` the handles it does not know); ``claim`` takes over the quota
charge of a caller's hand-over as it is stored."""

from __future__ import annotations

import logging
import threading

from engine_service.api.answers import TakenClone
from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import ForklineError, NotFound, QuotaExceeded, ResourceExhausted
from prefix_service.cache.budget import check_bound, check_share, engine_budget
from prefix_service.cache.outcomes import InsertRefusal
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway.gateway_backend import GatewayBackend

log = logging.getLogger(__name__)


class EnginePressure:
    """See the module docstring. The cache's bounds as given are the configured ones."""

    def __init__(
        self,
        cache: PrefixCache,
        backend: GatewayBackend,
        engine_share: float,
        pressure_retry: bool = True,
        max_cache_mib: int = 0,
    ) -> None:
        self.cache = cache
        self.backend = backend
        self.engine_share = check_share(engine_share)
        self.max_cache_mib = check_bound(max_cache_mib, "max_cache_mib")
        self.bytes_per_position = 0  # the engine's, as its Info last said (0: not reported)
        self.pressure_retry = pressure_retry
        self._configured = (cache.max_entries, cache.max_positions)
        self._lock = threading.Lock()
        self.pressure_evictions = self.pressure_retries = self.reclaimed = 0

    def apply_budget(self, info: EngineInfo) -> None:
        """Cap the cache at its share of the engine and at --max_cache_mib; evicts when the bounds shrink."""
        self.bytes_per_position = info.kv_bytes_per_position
        bounds = engine_budget(
            self.engine_share,
            *self._configured,
            engine_max_sessions=info.max_sessions,
            engine_max_session_tokens=info.max_session_tokens,
            engine_max_positions=info.max_positions,
            kv_bytes_per_position=info.kv_bytes_per_position,
            max_cache_mib=self.max_cache_mib,
            quota_sessions=info.caller_quota.max_sessions,
            quota_positions=info.caller_quota.max_positions,
        )
        if bounds != (self.cache.max_entries, self.cache.max_positions):
            evicted = self.cache.set_budget(*bounds)
            log.info(
                "prefix budget: %d entries, %d positions = %.0f MiB (share %.2f of %d sessions, %d "
                "positions at %d bytes; --max_cache_mib %d); evicted %d",
                *bounds,
                bounds[1] * info.kv_bytes_per_position / 2**20,
                self.engine_share,
                info.max_sessions,
                info.max_positions,
                info.kv_bytes_per_position,
                self.max_cache_mib,
                evicted,
            )

    def engine_full(self, call: CallContext | None = None) -> bool:
        """Whether the engine holds as many sessions as it can (one Info call)."""
        try:
            info = self.backend.info(call)
        except ForklineError:
            return False
        return 0 < info.max_sessions <= info.resident_sessions

    def relieve(self, exc: ResourceExhausted | None = None) -> bool:
        """Pressure from a live request: evict one entry by the policy and say whether to retry."""
        who = exc.owner if isinstance(exc, QuotaExceeded) else None
        if not self.pressure_retry or (who is not None and who != self.backend.owner):
            return False
        evicted = self.cache.evict(1)
        with self._lock:
            self.pressure_evictions += evicted
            self.pressure_retries += 1
        log.info("engine full for a live request: evicted %d entries, retrying once", evicted)
        return True

    def take_clone(self, session: str, upto: int, call: CallContext, digest: bytes) -> TakenClone | None:
        """An Insert's clone of ``call``'s session into the service's ownership; None when the
        service's own engine quota stays full after reclaiming the handles it does not know."""
        for attempt in range(2):
            try:
                return self.backend.take_clone(session, upto, call, digest)
            except ResourceExhausted as exc:
                if not (isinstance(exc, QuotaExceeded) and exc.owner == self.backend.owner):
                    raise
            if attempt or not self.reclaim(call):
                break
        return None

    def claim(self, handle: str, call: CallContext | None = None) -> InsertRefusal | None:
        """Take over the quota charge of ``handle`` (a caller's hand-over): None when claimed, else why it
        cannot be stored (OVER_BUDGET: the service's quota stays full; INVALID_SNAPSHOT: gone or no answer)."""
        for attempt in range(2):
            try:
                self.backend.claim(handle, call)
                return None
            except QuotaExceeded:
                if attempt or not self.reclaim(call):
                    return InsertRefusal.OVER_BUDGET
            except NotFound:
                return InsertRefusal.INVALID_SNAPSHOT
            except ForklineError as exc:  # e.g. the engine went away: the handle is not stored
                log.info("could not claim a snapshot handle: %s", exc)
                return InsertRefusal.INVALID_SNAPSHOT
        return InsertRefusal.OVER_BUDGET

    def reclaim(self, call: CallContext | None = None) -> int:
        """Release what the service's owner holds in the engine that it does not know; how many."""
        try:
            released = self.backend.reclaim(call)
        except ForklineError:
            log.warning("could not reclaim unknown handles", exc_info=True)
            return 0
        with self._lock:
            self.reclaimed += released
        if released:
            log.warning(
                "released %d handles held under %s that this service did not know",
                released,
                self.backend.owner,
            )
        return released
