"""HandleRegistry: unguessable session handles per owner, with idle expiry and quotas (thread-safe).

Each entry weighs one session and some positions, charged to its payer: its owner, or the client that
handed it to a persistent owner until that owner claims it. Spec: docs/SECURITY.md (quotas).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

from engine_service.api.checks import checked_float, checked_int
from engine_service.api.errors import InvalidArgument, NotFound, QuotaExceeded, ResourceExhausted
from engine_service.api.handle_names import handle_instance, is_instance_id, new_handle, new_instance_id
from engine_service.api.owners import NO_QUOTA, OwnerQuota, OwnerUsage

T = TypeVar("T")


DEFAULT_PERSISTENT_SHARE = 0.5


def engine_quotas(
    max_sessions: int,
    max_session_tokens: int,
    *,
    owner_max_sessions: int | None = None,
    owner_max_positions: int | None = None,
    persistent_owner_share: float = DEFAULT_PERSISTENT_SHARE,
) -> tuple[OwnerQuota, OwnerQuota]:
    """(each client's quota, each persistent owner's) from the engine's limits and quota flags (0: off)."""
    checked_float("persistent_owner_share", persistent_owner_share, lo=0, hi=1)
    # a client: a quarter of the sessions, half the positions those could hold (long ones count more)
    sessions = max(1, max_sessions // 4) if owner_max_sessions is None else owner_max_sessions
    positions = sessions * max_session_tokens // 2 if owner_max_positions is None else owner_max_positions
    if persistent_owner_share == 0:
        return OwnerQuota(sessions, positions), NO_QUOTA
    shared = max(1, int(persistent_owner_share * max_sessions + 1e-9))
    return OwnerQuota(sessions, positions), OwnerQuota(
        shared,
        max(max_session_tokens, int(persistent_owner_share * max_sessions * max_session_tokens + 1e-9)),
    )


@dataclass
class _Entry(Generic[T]):
    value: T | None  # None while pending
    owner: str
    last_used: float
    pins: int = 0
    positions: int = 0
    pending: bool = False
    payer: str = ""  # whose quota it counts in ("" -> the owner's; set in __post_init__)

    def __post_init__(self) -> None:
        self.payer = self.payer or self.owner


def _value(entry: _Entry[T]) -> T:
    return cast(T, entry.value)


@dataclass(frozen=True)
class Released(Generic[T]):
    handle: str
    owner: str
    value: T


@dataclass
class HandleRegistry(Generic[T]):
    """Handles to values, per owner. ``idle_timeout_s`` 0: no expiry; ``persistent_owners``' handles
    never expire. ``quota``: each client's; ``persistent_quota``: each persistent owner's."""

    instance_id: str = field(default_factory=new_instance_id)
    idle_timeout_s: float = 0.0
    clock: Callable[[], float] = time.monotonic
    persistent_owners: frozenset[str] = frozenset()
    quota: OwnerQuota = NO_QUOTA  # each client owner's
    persistent_quota: OwnerQuota = NO_QUOTA  # each persistent owner's
    max_positions: int = 0  # every handle's positions together, the engine's K/V bound (0: none)

    def __post_init__(self) -> None:
        if not is_instance_id(self.instance_id):
            raise InvalidArgument(f"instance_id must be 16 lowercase hex digits, got {self.instance_id!r}")
        checked_float("idle_timeout_s", self.idle_timeout_s, lo=0)
        checked_int("max_positions", self.max_positions, lo=0)
        if not isinstance(self.persistent_owners, frozenset):  # PersistentOwners (prefixes) stays as given
            self.persistent_owners = frozenset(self.persistent_owners)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[T]] = {}

    def register(self, value: T, owner: str, positions: int = 0) -> str:
        """A new handle for ``value`` owned by ``owner``, weighing ``positions``; QuotaExceeded."""
        handle = self.reserve(owner, positions)
        self.fill(handle, value)
        return handle

    def reserve(self, owner: str, positions: int = 0, *, payer: str = "") -> str:
        """A pending handle (:meth:`fill` or :meth:`discard` it), counted now against ``payer``
        (default the owner); QuotaExceeded."""
        if not owner:
            raise InvalidArgument("owner must be a non-empty string")
        payer = payer or owner
        handle = new_handle(self.instance_id)
        with self._lock:
            self._check(payer, 1, positions)
            self._entries[handle] = _Entry(
                None, owner, self.clock(), positions=positions, pending=True, payer=payer
            )
        return handle

    def claim(self, handle: str, owner: str) -> None:
        """``owner`` takes over the quota charge of ``handle`` from its giver; QuotaExceeded (nothing
        changes) or NotFound."""
        with self._lock:
            entry = self._entry(handle, owner)
            if entry.payer == owner:
                return
            self._check(owner, 1, entry.positions, moved=True)
            entry.payer = owner
            entry.last_used = self.clock()

    def payer_of(self, handle: str) -> str | None:
        with self._lock:
            entry = self._entries.get(handle)
            return None if entry is None else entry.payer

    def fill(self, handle: str, value: T) -> bool:
        """Give a reserved handle its value; False when the reservation is gone (close ``value`` then)."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None or not entry.pending:
                return False
            entry.value, entry.pending, entry.last_used = value, False, self.clock()
            return True

    def weigh(self, handle: str, positions: int, *, check: bool = False) -> None:
        """Set the positions the handle weighs; with ``check``, QuotaExceeded (unchanged) past the quota."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None:
                return
            if check and positions > entry.positions:
                self._check(entry.payer, 0, positions - entry.positions)
            entry.positions = positions

    def extend(self, handle: str, positions: int) -> int | None:
        """Raise the weight toward ``positions`` by what the payer's quota allows; the new weight, or
        None when the handle is gone."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None:
                return None
            if positions > entry.positions:
                entry.positions += min(positions - entry.positions, self._room(entry.payer))
            return entry.positions

    def _room(self, owner: str) -> int:
        limit = self.quota_for(owner).max_positions
        room = max(0, limit - self._held(owner)[1]) if limit else 1 << 62
        return min(room, max(0, self.max_positions - self._total())) if self.max_positions else room

    def held_positions(self) -> int:
        """Positions every handle and reservation holds together."""
        with self._lock:
            return self._total()

    def _total(self) -> int:
        return sum(e.positions for e in self._entries.values())

    def quota_for(self, owner: str) -> OwnerQuota:
        return self.persistent_quota if owner in self.persistent_owners else self.quota

    def usage(self, owner: str) -> OwnerUsage:
        with self._lock:
            sessions, positions = self._held(owner)
        return OwnerUsage(owner, owner in self.persistent_owners, sessions, positions, self.quota_for(owner))

    def _held(self, owner: str) -> tuple[int, int]:
        mine = [e.positions for e in self._entries.values() if e.payer == owner]
        return len(mine), sum(mine)

    def _check(self, owner: str, sessions: int, positions: int, *, moved: bool = False) -> None:
        """QuotaExceeded past ``owner``'s quota; ResourceExhausted past the engine's bound (unless the
        positions only move between payers)."""
        if (
            positions
            and self.max_positions
            and not moved
            and (total := self._total()) + positions > self.max_positions
        ):
            raise ResourceExhausted(
                f"the engine's K/V memory is full: its sessions hold {total} positions and this needs "
                f"{positions} more, past max_positions={self.max_positions} (--kv_memory_mib)"
            )
        quota = self.quota_for(owner)
        if not (quota.max_sessions or quota.max_positions):
            return
        prefix = "persistent_" if owner in self.persistent_owners else ""
        held, weight = self._held(owner)
        if sessions and quota.max_sessions and held + sessions > quota.max_sessions:
            raise QuotaExceeded(owner, held, "sessions", f"{prefix}owner_max_sessions", quota.max_sessions)
        if positions and quota.max_positions and weight + positions > quota.max_positions:
            raise QuotaExceeded(
                owner, weight, "positions", f"{prefix}owner_max_positions", quota.max_positions, positions
            )

    def _entry(self, handle: str, owner: str) -> _Entry[T]:
        # one NotFound for unknown, foreign and pending handles: a handle cannot be probed
        entry = self._entries.get(handle) if isinstance(handle, str) else None
        if entry is None or entry.owner != owner or entry.pending:
            if isinstance(handle, str) and (inst := handle_instance(handle)) and inst != self.instance_id:
                raise NotFound(
                    f"session {handle!r} was issued by engine instance {inst}, "
                    f"this is {self.instance_id} (the engine restarted)"
                )
            raise NotFound(f"unknown session handle {handle!r}")
        return entry

    def resolve(self, handle: str, owner: str) -> T:
        """The value behind ``handle`` for ``owner``; refreshes its idle time."""
        with self._lock:
            entry = self._entry(handle, owner)
            entry.last_used = self.clock()
            return _value(entry)  # a pending entry never resolves

    def pin(self, handle: str, owner: str) -> T:
        """Resolve and keep the handle from expiring until :meth:`unpin`."""
        with self._lock:
            entry = self._entry(handle, owner)
            entry.pins += 1
            entry.last_used = self.clock()
            return _value(entry)

    def unpin(self, handle: str) -> None:
        with self._lock:
            entry = self._entries.get(handle)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                entry.last_used = self.clock()

    def remove(self, handle: str, owner: str) -> T:
        """Forget the handle and return its value (the caller closes it)."""
        with self._lock:
            self._entry(handle, owner)
            return _value(self._entries.pop(handle))

    def discard(self, handle: str) -> T | None:
        """Forget the handle or reservation, whoever owns it; its value (None: gone or pending)."""
        with self._lock:
            entry = self._entries.pop(handle, None)
        return None if entry is None else entry.value

    def release_owner(
        self, owner: str, keep: Collection[str] = (), *, paid_only: bool = False
    ) -> list[Released[T]]:
        """Forget and return every handle ``owner`` holds or pays for (``paid_only``: pays for), except
        ``keep`` and reservations."""
        keep = frozenset(keep)
        with self._lock:
            gone = [
                h
                for h, e in self._entries.items()
                if (e.payer == owner or (not paid_only and e.owner == owner))
                and not e.pending
                and h not in keep
            ]
            return [Released(h, self._entries[h].owner, _value(self._entries.pop(h))) for h in gone]

    def release_all(self) -> list[Released[T]]:
        with self._lock:
            gone = [Released(h, e.owner, _value(e)) for h, e in self._entries.items() if not e.pending]
            self._entries.clear()
        return gone

    def expire_idle(self) -> list[Released[T]]:
        """Forget and return unpinned handles idle past ``idle_timeout_s`` whose payer is a client."""
        if self.idle_timeout_s == 0:
            return []
        deadline = self.clock() - self.idle_timeout_s
        with self._lock:
            gone = [
                h
                for h, e in self._entries.items()
                if e.pins == 0
                and not e.pending
                and e.last_used < deadline
                and e.payer not in self.persistent_owners
            ]
            return [Released(h, self._entries[h].owner, self._entries.pop(h).value) for h in gone]

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if not e.pending)

    def count(self, owner: str) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.owner == owner and not e.pending)
