"""EngineSessions.clone: who may receive it, whose quota pays, and every refusal's reason."""

from __future__ import annotations

import pytest

from engine_service.api.answers import CloneRefusal
from engine_service.api.content import content_digest
from engine_service.api.errors import Cancelled, InvalidArgument, NotFound, QuotaExceeded, Stopping
from engine_service.api.owners import OwnerQuota
from tests.unit.sessions.conftest import PERSISTENT, resident, run, started

PROMPT = [ord(c) for c in "jumps over the lazy dog"]


@pytest.fixture
def kept(sessions) -> str:
    """alice's session holding PROMPT and one generated token (position len(PROMPT))."""
    return started(run(sessions, "alice", PROMPT, max_new_tokens=1, keep_session=True)).session


def test_a_clone_holds_the_prefix_it_was_asked_for(sessions, kept) -> None:
    taken = sessions.clone("alice", kept, 10, expected_digest=content_digest(PROMPT[:10]))
    assert taken.handle is not None and taken.refusal is None
    assert taken.content_digest == content_digest(PROMPT[:10])
    assert sessions.describe("alice", taken.handle).position == 10
    with pytest.raises(NotFound):  # the child is alice's
        sessions.describe("bob", taken.handle)


@pytest.mark.parametrize(
    ("upto", "digest", "refusal"),
    [
        (len(PROMPT) + 1, b"", CloneRefusal.POSITION),
        (10, content_digest(PROMPT[:9] + [0]), CloneRefusal.CONTENT_MISMATCH),
    ],
)
def test_refused_clones_say_why_and_hold_nothing(sessions, kept, upto, digest, refusal) -> None:
    taken = sessions.clone("alice", kept, upto, expected_digest=digest)
    assert (taken.handle, taken.refusal) == (None, refusal)
    assert sessions.registry.usage("alice").sessions == 1 and resident(sessions) == 1


def test_bad_clone_arguments_are_invalid(sessions, kept) -> None:
    with pytest.raises(InvalidArgument, match="upto must be >= 0"):
        sessions.clone("alice", kept, -1)
    with pytest.raises(InvalidArgument, match="new_owner 'bob'"):
        sessions.clone("alice", kept, 5, new_owner="bob")
    with pytest.raises(InvalidArgument, match="expected_content_digest"):
        sessions.clone("alice", kept, 5, expected_digest=b"short")


def test_a_clone_handed_to_the_persistent_owner_counts_against_alice_until_claimed(make_sessions) -> None:
    engine = make_sessions(quota=OwnerQuota(max_sessions=2))
    kept = started(run(engine, "alice", PROMPT, max_new_tokens=1, keep_session=True)).session
    handed = engine.clone("alice", kept, 5, new_owner=PERSISTENT).handle
    assert engine.describe(PERSISTENT, handed).position == 5  # the receiver's handle
    assert (engine.registry.usage("alice").sessions, engine.registry.usage(PERSISTENT).sessions) == (2, 0)
    with pytest.raises(QuotaExceeded):  # alice pays for it: her quota of 2 is full
        engine.clone("alice", kept, 5)
    engine.claim(PERSISTENT, handed)
    assert (engine.registry.usage("alice").sessions, engine.registry.usage(PERSISTENT).sessions) == (1, 1)
    assert engine.clone("alice", kept, 5).handle is not None  # room again


def test_a_clone_the_caller_left_is_released_and_cancelled(sessions, kept) -> None:
    with pytest.raises(Cancelled):
        sessions.clone("alice", kept, 5, wanted=lambda: False)
    assert sessions.registry.usage("alice").sessions == 1 and resident(sessions) == 1


def test_release_owner_closes_what_alice_holds_and_handed_over(sessions, kept) -> None:
    sessions.clone("alice", kept, 5, new_owner=PERSISTENT)
    stored = sessions.clone("alice", kept, 6, new_owner=PERSISTENT).handle
    sessions.claim(PERSISTENT, stored)  # claimed: the prefix service's now
    assert sessions.release_owner("alice") == 2  # her session and the unclaimed hand-over
    assert resident(sessions) == 1 and sessions.describe(PERSISTENT, stored).position == 6


def test_a_draining_engine_refuses_clones_and_claims(sessions, kept) -> None:
    sessions.drain()
    with pytest.raises(Stopping):
        sessions.clone("alice", kept, 5)
    with pytest.raises(Stopping):
        sessions.claim(PERSISTENT, kept)
    sessions.close("alice", kept)  # closing still works
    assert resident(sessions) == 0
