"""Owners: who holds engine sessions (the token's owner, else the ``forkline-owner`` header), and how
much each may hold. A persistent owner (the prefix service) holds snapshots on purpose: its handles
never expire and it has its own budget. Spec: docs/SECURITY.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument

DEFAULT_OWNER = "anonymous"  # a call that names no owner
PERSISTENT_OWNER = "prefix-service"  # the prefix service's owner id, the engine's default persistent owner
MAX_OWNER_LENGTH = 128


def check_owner(owner: str, field: str) -> str:
    """``owner`` when it is 1..MAX_OWNER_LENGTH characters, else InvalidArgument naming ``field``."""
    if not owner or len(owner) > MAX_OWNER_LENGTH:
        raise InvalidArgument(f"{field} must be 1..{MAX_OWNER_LENGTH} characters, got {len(owner)}")
    return owner


class PersistentOwners(frozenset):
    """Owner ids that also contain every id starting with one of ``prefixes`` (e.g. the prefix replicas
    ``forkline-prefix-0``, ``-1``, ...); iterating yields the listed ids only."""

    prefixes: tuple[str, ...]

    def __new__(cls, names: Iterable[str] = (), prefixes: Iterable[str] = ()) -> PersistentOwners:
        owners = super().__new__(cls, names)
        owners.prefixes = tuple(sorted(set(prefixes)))
        for prefix in owners.prefixes:
            check_owner(prefix, "persistent owner prefix")
        return owners

    def __contains__(self, owner: object) -> bool:
        return super().__contains__(owner) or (
            isinstance(owner, str) and any(owner.startswith(p) for p in self.prefixes)
        )

    def __reduce__(self):
        return (PersistentOwners, (tuple(self), self.prefixes))

    def describe(self) -> str:
        return ", ".join([*sorted(self), *(f"{p}*" for p in self.prefixes)]) or "none configured"


@dataclass(frozen=True)
class OwnerQuota:
    """What one owner may hold at most: resident sessions and positions (0: unlimited)."""

    max_sessions: int = 0
    max_positions: int = 0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_positions"):
            checked_int(name, getattr(self, name), lo=0)


NO_QUOTA = OwnerQuota()


@dataclass(frozen=True)
class OwnerUsage:
    """What ``owner`` holds now (reservations included), its quota, and whether it is persistent."""

    owner: str
    persistent: bool
    sessions: int
    positions: int
    quota: OwnerQuota = NO_QUOTA
