"""Session handles: opaque, unguessable names for engine sessions held by remote clients.

A handle is ``"<instance id>.<32 hex digits>"``: 128 random bits from :mod:`secrets` after the id of
the engine instance that issued it. Every handle belongs to one owner (a client-chosen string such as
``"prefix-service"``); only that owner can resolve or remove it, and everything an owner holds can be
released at once. A handle that is unknown, malformed, issued by another engine instance, owned by
someone else, expired or removed raises :class:`NotFound`: callers cannot tell these apart, so a
handle cannot be probed for existence.

Idle expiry: each resolve refreshes a handle's last-use time; :meth:`HandleRegistry.expire_idle`
removes handles idle for longer than ``idle_timeout_s`` and returns their values so the caller can
close them. A *pinned* handle (e.g. its session is generating) never expires; expiry counts from the
unpin.

The registry is thread-safe and holds arbitrary values; it knows nothing about sessions or gRPC.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engine_service.errors import InvalidArgument, NotFound

T = TypeVar("T")

HANDLE_RANDOM_BITS = 128
_INSTANCE_RE = re.compile(r"^[0-9a-f]{16}$")
_HANDLE_RE = re.compile(r"^([0-9a-f]{16})\.([0-9a-f]{32})$")


def new_instance_id() -> str:
    """A fresh random engine instance id: 64 bits as 16 lowercase hex digits."""
    return secrets.token_hex(8)


def handle_instance(handle: str) -> str | None:
    """The instance id a well-formed handle carries, or None for a malformed one."""
    match = _HANDLE_RE.match(handle)
    return match.group(1) if match else None


@dataclass
class _Entry(Generic[T]):
    value: T
    owner: str
    last_used: float
    pins: int = 0


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
    releases its leftovers itself at start) never expire."""

    instance_id: str = field(default_factory=new_instance_id)
    idle_timeout_s: float = 0.0
    clock: Callable[[], float] = time.monotonic
    persistent_owners: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not _INSTANCE_RE.match(self.instance_id):
            raise InvalidArgument(f"instance_id must be 16 lowercase hex digits, got {self.instance_id!r}")
        if not self.idle_timeout_s >= 0:
            raise InvalidArgument(f"idle_timeout_s must be >= 0, got {self.idle_timeout_s}")
        self.persistent_owners = frozenset(self.persistent_owners)
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry[T]] = {}

    def register(self, value: T, owner: str) -> str:
        """A new handle for ``value`` owned by ``owner``."""
        if not owner:
            raise InvalidArgument("owner must be a non-empty string")
        handle = f"{self.instance_id}.{secrets.token_hex(HANDLE_RANDOM_BITS // 8)}"
        with self._lock:
            self._entries[handle] = _Entry(value, owner, self.clock())
        return handle

    def _entry(self, handle: str, owner: str) -> _Entry[T]:
        """The live entry (lock held) or NotFound with a message that leaks nothing about other owners."""
        entry = self._entries.get(handle) if isinstance(handle, str) else None
        if entry is None or entry.owner != owner:
            if isinstance(handle, str) and (inst := handle_instance(handle)) and inst != self.instance_id:
                raise NotFound(f"session {handle!r} was issued by engine instance {inst}, "
                               f"this is {self.instance_id} (the engine restarted)")
            raise NotFound(f"unknown session handle {handle!r}")
        return entry

    def resolve(self, handle: str, owner: str) -> T:
        """The value behind ``handle`` for ``owner``; refreshes its idle time."""
        with self._lock:
            entry = self._entry(handle, owner)
            entry.last_used = self.clock()
            return entry.value

    def pin(self, handle: str, owner: str) -> T:
        """Resolve and keep the handle from expiring until :meth:`unpin`."""
        with self._lock:
            entry = self._entry(handle, owner)
            entry.pins += 1
            entry.last_used = self.clock()
            return entry.value

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
            return self._entries.pop(handle).value

    def discard(self, handle: str) -> T | None:
        """Forget the handle whoever owns it (internal cleanup); None when already gone."""
        with self._lock:
            entry = self._entries.pop(handle, None)
        return None if entry is None else entry.value

    def release_owner(self, owner: str) -> list[Released[T]]:
        """Forget every handle ``owner`` holds and return them."""
        with self._lock:
            gone = [h for h, e in self._entries.items() if e.owner == owner]
            return [Released(h, owner, self._entries.pop(h).value) for h in gone]

    def release_all(self) -> list[Released[T]]:
        """Forget every handle (shutdown)."""
        with self._lock:
            gone = [Released(h, e.owner, e.value) for h, e in self._entries.items()]
            self._entries.clear()
        return gone

    def expire_idle(self) -> list[Released[T]]:
        """Forget unpinned handles idle for longer than ``idle_timeout_s`` and return them."""
        if self.idle_timeout_s == 0:
            return []
        deadline = self.clock() - self.idle_timeout_s
        with self._lock:
            gone = [
                h
                for h, e in self._entries.items()
                if e.pins == 0 and e.last_used < deadline and e.owner not in self.persistent_owners
            ]
            return [Released(h, self._entries[h].owner, self._entries.pop(h).value) for h in gone]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def count(self, owner: str) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.owner == owner)
