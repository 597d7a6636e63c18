"""The hand-over rule: to or from a persistent owner only; the giving client pays until claimed."""

from __future__ import annotations

import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.sessions.ownership import payer_of, receiver_of

PERSISTENT = frozenset({"prefix-service"})


@pytest.mark.parametrize(
    ("owner", "requested", "receiver"),
    [
        ("alice", "", "alice"),
        ("alice", "alice", "alice"),
        ("alice", "prefix-service", "prefix-service"),  # a client hands a snapshot to the prefix service
        ("prefix-service", "alice", "alice"),  # the prefix service hands a clone to its caller
    ],
)
def test_allowed_receivers(owner, requested, receiver) -> None:
    assert receiver_of(owner, requested, "new_owner", PERSISTENT) == receiver


@pytest.mark.parametrize("requested", ["bob", "x" * 129])
def test_a_client_cannot_hand_a_session_to_another_client(requested) -> None:
    with pytest.raises(InvalidArgument, match="^new_owner"):
        receiver_of("alice", requested, "new_owner", PERSISTENT)


@pytest.mark.parametrize(
    ("giver", "receiver", "payer"),
    [
        ("alice", "alice", "alice"),
        ("alice", "prefix-service", "alice"),  # until the prefix service claims it
        ("prefix-service", "alice", "alice"),
        ("prefix-service", "prefix-service", "prefix-service"),
    ],
)
def test_payer(giver, receiver, payer) -> None:
    assert payer_of(giver, receiver, PERSISTENT) == payer
