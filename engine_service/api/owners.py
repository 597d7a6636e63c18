"""Owners: who holds engine sessions, and how much each may hold.

Every session handle belongs to one owner id (1..:data:`MAX_OWNER_LENGTH` characters): the token's
owner with auth on, else the caller's ``forkline-owner`` header, else :data:`DEFAULT_OWNER`. A
*persistent* owner (by default :data:`PERSISTENT_OWNER`, the prefix service) holds snapshots on
purpose: its handles never expire and it has the persistent budget instead of the client quota.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_service.api.errors import InvalidArgument

DEFAULT_OWNER = "anonymous"  # a call that names no owner
PERSISTENT_OWNER = "prefix-service"  # the prefix service's owner id, the engine's default persistent owner
MAX_OWNER_LENGTH = 128


def check_owner(owner: str, field: str) -> str:
    """``owner`` when it is 1..MAX_OWNER_LENGTH characters, else InvalidArgument naming ``field``."""
    if not owner or len(owner) > MAX_OWNER_LENGTH:
        raise InvalidArgument(f"{field} must be 1..{MAX_OWNER_LENGTH} characters, got {len(owner)}")
    return owner


@dataclass(frozen=True)
class OwnerQuota:
    """What one owner may hold at most: resident sessions and positions (0: unlimited)."""

    max_sessions: int = 0
    max_positions: int = 0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{name} must be an int >= 0, got {value!r}")


NO_QUOTA = OwnerQuota()


@dataclass(frozen=True)
class OwnerUsage:
    """What ``owner`` holds now (reservations included), its quota, and whether it is persistent."""

    owner: str
    persistent: bool
    sessions: int
    positions: int
    quota: OwnerQuota = NO_QUOTA
