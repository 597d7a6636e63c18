"""Budget: how much a PrefixCache may hold, in the engine's units -- entries (one resident session
each) and positions (0 entries: disabled; 0 positions: unbounded; bytes = positions x the engine's
bytes per position) -- and the :class:`Reservation`s taken for snapshots on their way (they count like
entries until consumed or released); :func:`engine_budget`: the bounds from the engine's Info."""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.outcomes import InsertRefusal
from prefix_service.cache.retention import Entry, RetentionPolicy


def check_bound(value: int, name: str) -> int:
    """A budget bound: an int >= 0 (InvalidArgument naming ``name`` otherwise)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{name} must be an int >= 0, got {value!r}")
    return value


class Budget:
    """The stored entries and their bounds, guarded by the cache's ``lock``: ``positions`` are held
    by the entries (their key lengths, or ``held()`` where clones share a prefix's storage),
    ``reserved_*`` by reservations. Evictions take the retention policy's victim and hand it to
    ``drop`` (the cache unindexes it, calls :meth:`discard` and releases its snapshot)."""

    def __init__(
        self,
        policy: RetentionPolicy,
        max_entries: int,
        max_positions: int,
        drop: Callable[[Entry], None],
        lock: threading.RLock,
        held: Callable[[], int] | None = None,
    ) -> None:
        self.policy = policy
        self._held = held
        self._drop = drop
        self._lock = lock
        self.evictions = 0
        self.max_entries = check_bound(max_entries, "max_entries")
        self.max_positions = check_bound(max_positions, "max_positions")
        self.entries: set[Entry] = set()
        self.key_positions = 0  # the sum of the entries' key lengths
        self.reserved_entries = 0
        self.reserved_positions = 0

    def set_bounds(self, max_entries: int, max_positions: int) -> None:
        self.max_entries = check_bound(max_entries, "max_entries")
        self.max_positions = check_bound(max_positions, "max_positions")

    @property
    def positions(self) -> int:
        """What the entries hold: ``held()`` where given (shared prefixes counted once), else the
        sum of their key lengths (a whole copy each)."""
        return self._held() if self._held is not None else self.key_positions

    def add(self, entry: Entry) -> None:
        self.entries.add(entry)
        self.key_positions += entry.key_length

    def discard(self, entry: Entry) -> None:
        if entry in self.entries:
            self.entries.remove(entry)
            self.key_positions -= entry.key_length

    def clear(self) -> list[Entry]:
        """Forget every entry; returns them."""
        entries, self.entries, self.key_positions = list(self.entries), set(), 0
        return entries

    def over(self, extra_entries: int = 0, extra_positions: int = 0) -> bool:
        """Whether the entries, the reservations and the extra exceed a bound."""
        if len(self.entries) + self.reserved_entries + extra_entries > self.max_entries:
            return True
        used = self.positions + self.reserved_positions + extra_positions
        return bool(self.max_positions) and used > self.max_positions

    def evict(self, n: int = 1) -> int:
        """Evict up to ``n`` entries by the policy; how many were evicted."""
        with self._lock:
            evicted = 0
            while evicted < n and self.entries:
                self._evict_one()
                evicted += 1
            return evicted

    def evict_while_over(self, extra_entries: int = 0, extra_positions: int = 0) -> list[Entry]:
        """Evict by the policy until the entries, reservations and extra fit the bounds; the victims."""
        with self._lock:
            victims = []
            while self.entries and self.over(extra_entries, extra_positions):
                victims.append(self._evict_one())
            return victims

    def _evict_one(self) -> Entry:
        victim = self.policy.victim(self.entries)
        self.evictions += 1
        self._drop(victim)
        return victim

    def can_ever_hold(self, positions: int) -> bool:
        """Whether one entry of ``positions`` fits an empty cache."""
        return self.max_entries > 0 and (not self.max_positions or positions <= self.max_positions)

    def reserve(self, newcomer: Entry) -> Reservation | InsertRefusal:
        """Room for ``newcomer`` (not stored yet), evicting the victims the policy ranks below it; else why
        not: EVICTED (it would be the victim), OVER_BUDGET (never fits, or reservations hold the rest)."""
        positions = newcomer.key_length
        with self._lock:
            if self.max_entries == 0:
                return InsertRefusal.DISABLED
            if not self.can_ever_hold(positions):
                return InsertRefusal.OVER_BUDGET
            while self.entries and self.over(1, positions):
                victim = self.policy.victim(self.entries)
                if self.policy.priority(newcomer) < self.policy.priority(victim):
                    return InsertRefusal.EVICTED
                self.evictions += 1
                self._drop(victim)
            if self.over(1, positions):
                return InsertRefusal.OVER_BUDGET
            self.reserved_entries += 1
            self.reserved_positions += positions
            return Reservation(positions, self._unreserve)

    def _unreserve(self, reservation: Reservation) -> None:
        with self._lock:
            self.reserved_entries -= 1
            self.reserved_positions -= reservation.positions


class Reservation:
    """Room for one entry of ``positions`` positions. ``release()`` gives it
    back once; an insert that receives it releases it as it adds the entry."""

    def __init__(self, positions: int, on_release: Callable[[Reservation], None]) -> None:
        self.positions = positions
        self._on_release = on_release
        self._lock = threading.Lock()
        self._held = True

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._on_release(self)


DEFAULT_ENGINE_SHARE = 0.5
# entries are not the scarce resource (an idle engine session costs only what it holds): the engine's
# K/V positions and its session share bind first
DEFAULT_MAX_ENTRIES = 4096


def check_share(share: float, name: str = "engine_share") -> float:
    """A share of the engine: a number in (0, 1] (InvalidArgument naming ``name`` otherwise)."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        raise InvalidArgument(f"{name} must be in (0, 1], got {share!r}")
    return float(share)


MIB = 1 << 20


def engine_budget(
    share: float,
    max_entries: int,
    max_positions: int,
    *,
    engine_max_sessions: int,
    engine_max_session_tokens: int,
    engine_max_positions: int = 0,
    kv_bytes_per_position: int = 0,
    max_cache_mib: int = 0,
    quota_sessions: int = 0,
    quota_positions: int = 0,
) -> tuple[int, int]:
    """The (entries, positions) a prefix service may hold in an engine: its configured bounds capped by
    ``share`` of the engine's sessions and of its K/V positions (``engine_max_positions``; 0, an engine
    that does not report it: sessions x their tokens), by ``max_cache_mib`` over the engine's bytes per
    position (0: no byte cap of its own), and by its quota there (0: no cap)."""
    entries, caps = max_entries, []
    if engine_max_sessions > 0:
        entries = min(entries, int(share * engine_max_sessions + 1e-9))
        held = engine_max_positions or engine_max_sessions * engine_max_session_tokens
        caps.append(int(share * held + 1e-9))
    if max_cache_mib and kv_bytes_per_position > 0:
        caps.append(max_cache_mib * MIB // kv_bytes_per_position)
    if quota_sessions:
        entries = min(entries, quota_sessions)
    if quota_positions:
        caps.append(quota_positions)
    positions = max_positions
    for cap in caps:  # a cap is a bound: at least one position (0 would mean unbounded)
        positions = min(positions, max(1, cap)) if positions else max(1, cap)
    return entries, positions
