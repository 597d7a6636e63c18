"""Who receives a session one owner makes for another, and whose quota it counts in: a hand-over is
allowed only to or from a persistent owner, and a client pays for what it hands over until claimed."""

from __future__ import annotations

from engine_service.api.errors import InvalidArgument
from engine_service.api.owners import check_owner


def receiver_of(owner: str, requested: str, field: str, persistent: frozenset[str]) -> str:
    """``requested`` ("": ``owner``) when either is a persistent owner, else InvalidArgument."""
    if not requested or requested == owner:
        return owner
    receiver = check_owner(requested, field)
    if owner not in persistent and receiver not in persistent:
        names = ", ".join(sorted(persistent)) or "none configured"
        raise InvalidArgument(
            f"{field} {receiver!r}: only a persistent owner ({names}) can receive or give another owner's session"
        )
    return receiver


def payer_of(giver: str, receiver: str, persistent: frozenset[str]) -> str:
    """The giver while a client's hand-over to a persistent owner is unclaimed, else the receiver."""
    return giver if receiver in persistent and giver not in persistent else receiver
