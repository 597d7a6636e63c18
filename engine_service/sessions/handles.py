"""HandleRegistry: opaque, unguessable handles (``api.handle_names``) for sessions held by remote
callers, per owner, with idle expiry and quotas. Thread-safe; holds arbitrary values.

- Only a handle's owner resolves or removes it; unknown, malformed, foreign, another instance's,
  expired and removed handles all raise the same NotFound (a handle cannot be probed).
- Each resolve refreshes its idle time; :meth:`HandleRegistry.expire_idle` removes unpinned client
  handles idle past ``idle_timeout_s`` (persistent owners' never expire) and returns them to close.
- Quotas: an entry weighs one session and the positions its caller says, charged to its *payer*: its
  owner, except a session a client handed to a persistent owner (a clone or snapshot with another
  owner), which counts against the giving client until its owner claims it (:meth:`HandleRegistry.claim`;
  the prefix service does as it stores it) or it is released -- so nobody fills a persistent owner's
  budget with sessions it never asked for. Each payer's entries stay within ``quota`` (clients) or
  ``persistent_quota`` (each persistent owner), or the call raises ``QuotaExceeded`` before anything is
  allocated. :meth:`HandleRegistry.reserve` counts a *pending* entry (unresolvable, never expired) that
  :meth:`HandleRegistry.fill` gives its value; :meth:`HandleRegistry.extend` grows an entry's weight by
  what still fits (a generation's reservation).
- Expiry follows the payer: an unclaimed hand-over expires like its giver's own handles.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

from engine_service.api.checks import checked_float
from engine_service.api.errors import InvalidArgument, NotFound, QuotaExceeded
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
    """The engine's (client quota, persistent owners' budget) from its limits and the flags.

    Defaults: a client holds at most a quarter of the sessions (``max(1, max_sessions // 4)``) and half
    the positions those sessions could hold (``owner_max_sessions * max_session_tokens // 2``: long
    sessions count for more); 0 turns either off. A persistent owner (the prefix service) gets
    ``persistent_owner_share`` of the sessions and of the positions (``max_sessions *
    max_session_tokens``), at least one session; share 0 turns its budget off.
    """
    checked_float("persistent_owner_share", persistent_owner_share, lo=0, hi=1)
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
    """The value of an entry that is not pending."""
    return cast(T, entry.value)


@dataclass(frozen=True)
class Released(Generic[T]):
    """A value removed from the registry, with the handle it had."""

    handle: str
    owner: str
    value: T


@dataclass
class HandleRegistry(Generic[T]):
    """Maps handles to values, per owner. ``idle_timeout_s`` 0 disables expiry; handles of
    ``persistent_owners`` (services that hold snapshots on purpose, e.g. the prefix service, which
    releases its leftovers itself at start) never expire. ``quota`` bounds what each client owner
    holds, ``persistent_quota`` what each persistent owner holds (see the module docstring)."""

    instance_id: str = field(default_factory=new_instance_id)
    idle_timeout_s: float = 0.0
    clock: Callable[[], float] = time.monotonic
    persistent_owners: frozenset[str] = frozenset()
    quota: OwnerQuota = NO_QUOTA  # each client owner's
    persistent_quota: OwnerQuota = NO_QUOTA  # each persistent owner's

    def __post_init__(self) -> None:
        if not is_instance_id(self.instance_id):
            raise InvalidArgument(f"instance_id must be 16 lowercase hex digits, got {self.instance_id!r}")
        checked_float("idle_timeout_s", self.idle_timeout_s, lo=0)
        if not isinstance(self.persistent_owners, frozenset):  # PersistentOwners (prefixes) stays as given
            self.persistent_owners = frozenset(self.persistent_owners)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[T]] = {}

    def register(self, value: T, owner: str, positions: int = 0) -> str:
        """A new handle for ``value`` owned by ``owner``, weighing ``positions`` (QuotaExceeded when
        the owner's quota has no room)."""
        handle = self.reserve(owner, positions)
        self.fill(handle, value)
        return handle

    def reserve(self, owner: str, positions: int = 0, *, payer: str = "") -> str:
        """A pending handle for a value still to be made (:meth:`fill` it, or :meth:`discard` it): it
        counts against ``payer``'s quota now (default the owner's; QuotaExceeded when there is no room)."""
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
        """``owner`` takes over the quota charge of its ``handle`` (a session handed to it, counting
        against its giver until now): QuotaExceeded when ``owner``'s quota has no room for it (nothing
        changes then); NotFound as :meth:`resolve`. A handle ``owner`` already pays for is left as is."""
        with self._lock:
            entry = self._entry(handle, owner)
            if entry.payer == owner:
                return
            self._check(owner, 1, entry.positions)
            entry.payer = owner
            entry.last_used = self.clock()

    def payer_of(self, handle: str) -> str | None:
        """Whose quota ``handle`` counts in (None when it is gone); for tests and diagnostics."""
        with self._lock:
            entry = self._entries.get(handle)
            return None if entry is None else entry.payer

    def fill(self, handle: str, value: T) -> bool:
        """Give a reserved handle its value; False when the reservation is gone (its owner released
        everything meanwhile, or shutdown): the caller then closes ``value``."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None or not entry.pending:
                return False
            entry.value, entry.pending, entry.last_used = value, False, self.clock()
            return True

    def weigh(self, handle: str, positions: int, *, check: bool = False) -> None:
        """Set how many positions the handle weighs (e.g. a generation starting on it: what it may
        reach; its end: its position). With ``check``, QuotaExceeded when its owner's quota has no room
        for the new weight (the weight is then unchanged). A removed handle is ignored."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None:
                return
            if check and positions > entry.positions:
                self._check(entry.payer, 0, positions - entry.positions)
            entry.positions = positions

    def extend(self, handle: str, positions: int) -> int | None:
        """Raise the handle's weight toward ``positions`` by as much as its owner's quota has room for
        (a generation's reservation growing as it produces tokens); never lowers it. Returns the new
        weight, None when the handle is gone."""
        with self._lock:
            entry = self._entries.get(handle)
            if entry is None:
                return None
            if positions > entry.positions:
                entry.positions += min(positions - entry.positions, self._room(entry.payer))
            return entry.positions

    def _room(self, owner: str) -> int:
        """Positions ``owner`` may still add (lock held); a very large number without a positions quota."""
        limit = self.quota_for(owner).max_positions
        return max(0, limit - self._held(owner)[1]) if limit else 1 << 62

    def quota_for(self, owner: str) -> OwnerQuota:
        return self.persistent_quota if owner in self.persistent_owners else self.quota

    def usage(self, owner: str) -> OwnerUsage:
        with self._lock:
            sessions, positions = self._held(owner)
        return OwnerUsage(owner, owner in self.persistent_owners, sessions, positions, self.quota_for(owner))

    def _held(self, owner: str) -> tuple[int, int]:
        """(sessions, positions) ``owner`` pays for, reservations and unclaimed hand-overs included
        (lock held)."""
        mine = [e.positions for e in self._entries.values() if e.payer == owner]
        return len(mine), sum(mine)

    def _check(self, owner: str, sessions: int, positions: int) -> None:
        """QuotaExceeded unless ``owner`` has room for ``sessions`` more and ``positions`` more (lock held)."""
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
        """The live entry (lock held) or NotFound with a message that leaks nothing about other owners."""
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
        """Undo one :meth:`pin`; a removed handle is ignored."""
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
        """Forget the handle (or reservation) whoever owns it (internal cleanup); None when already
        gone or still pending."""
        with self._lock:
            entry = self._entries.pop(handle, None)
        return None if entry is None else entry.value

    def release_owner(self, owner: str, keep: Collection[str] = ()) -> list[Released[T]]:
        """Forget every handle ``owner`` holds or pays for (its hand-overs nobody claimed yet), except
        those in ``keep`` and the reservations of calls in flight, and return them."""
        keep = frozenset(keep)
        with self._lock:
            gone = [
                h
                for h, e in self._entries.items()
                if owner in (e.owner, e.payer) and not e.pending and h not in keep
            ]
            return [Released(h, self._entries[h].owner, _value(self._entries.pop(h))) for h in gone]

    def release_all(self) -> list[Released[T]]:
        """Forget every handle and reservation (shutdown); returns the handles."""
        with self._lock:
            gone = [Released(h, e.owner, _value(e)) for h, e in self._entries.items() if not e.pending]
            self._entries.clear()
        return gone

    def expire_idle(self) -> list[Released[T]]:
        """Forget unpinned handles idle for longer than ``idle_timeout_s`` and return them (a
        persistent owner's never expire, unless a client still pays for them: an unclaimed hand-over)."""
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
        """Live handles (reservations excluded)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if not e.pending)

    def count(self, owner: str) -> int:
        """Live handles ``owner`` holds (reservations excluded)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.owner == owner and not e.pending)
