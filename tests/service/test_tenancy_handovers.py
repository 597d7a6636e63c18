"""Hand-overs count against the giver until claimed (issue 21 item 6), over real engine and prefix
servers on port 0 with the engine's per-owner quotas.

The issue's attack: alice, within her quota, hands 16 cheap clones to the prefix service's owner
(``EngineClient.clone(..., new_owner="prefix-service")``) before each of bob's rounds, never inserting
them. Had they counted against the prefix service, they would fill its budget and push out bob's
entry. They count against alice until the service claims them (it claims only what it stores): she
meets her own quota, named in the refusal, and bob's repeat reuses his whole prompt. Control: a clone
that alice does insert is claimed and counts against the service's budget, not hers.
"""

from __future__ import annotations

import pytest

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import QuotaExceeded, ResourceExhausted
from engine_service.sessions.handles import engine_quotas
from tests.service.helpers import PROMPT

MAX_SESSIONS = 16
MAX_SESSION_TOKENS = 256
QUOTA, BUDGET = engine_quotas(MAX_SESSIONS, MAX_SESSION_TOKENS)  # alice / bob: 4 sessions; the service: 8
SERVICE = "prefix-service"
BOB_PROMPT = [ord(c) for c in "Bob's own question about the weather in Lisbon, please. "] * 2
HAND_OVERS = 16


def hand_over(alice: EngineClient, session: str, n: int) -> tuple[list[str], list[ResourceExhausted]]:
    """Alice clones ``session`` (at its position: a ring layer holds no earlier rows) to the service's
    owner ``n`` times: (handles, refusals)."""
    handed, refused = [], []
    for _ in range(n):
        try:
            handle = alice.clone(session, len(PROMPT), new_owner=SERVICE)
        except ResourceExhausted as exc:
            refused.append(exc)
            continue
        assert handle is not None
        handed.append(handle)
    return handed, refused


@pytest.fixture
def pair(engine_factory, prefix_factory):
    """(engine with the CLI's quotas, prefix service over it)."""
    assert (QUOTA.max_sessions, BUDGET.max_sessions) == (4, 8)
    engine = engine_factory(
        max_sessions=MAX_SESSIONS, max_session_tokens=MAX_SESSION_TOKENS, quota=QUOTA, persistent_quota=BUDGET
    )
    return engine, prefix_factory(engine.address)


def test_hand_overs_count_in_the_givers_quota_and_bobs_prompt_stays_cached(pair) -> None:
    engine, prefix = pair
    registry = engine.deps.registry
    alice = EngineClient(engine.address, owner="alice")
    bob = PrefixClient(prefix.address, owner="bob")
    source = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    reused = []
    for round_ in range(4):
        handed, refused = hand_over(alice, source, HAND_OVERS)
        # her quota stops her: 4 sessions, the source and 3 hand-overs (all of them in round 0)
        assert len(handed) == (3 if round_ == 0 else 0) and len(refused) == HAND_OVERS - len(handed)
        assert all(
            isinstance(r, QuotaExceeded)
            and (r.owner, r.quota, r.limit) == ("alice", "owner_max_sessions", 4)
            and "owner 'alice' holds 4 sessions, owner_max_sessions=4" in str(r)
            for r in refused
        ), refused
        assert all(registry.payer_of(h) == "alice" for h in handed)  # not the service's budget
        assert registry.usage("alice").sessions == 4
        done = bob.generate(BOB_PROMPT, config=GenConfig(max_new_tokens=1)).collect().done
        reused.append(done.reused_positions)
    assert reused == [0] + [len(BOB_PROMPT) - 1] * 3  # bob's whole prompt, every repeat
    stats = bob.stats()
    assert stats.pressure_evictions == 0 and stats.entries == 1
    # the service pays only for what it stores (bob's entry)
    assert registry.usage(SERVICE).sessions == len(prefix.cache)
    # her hand-overs go with her release, as her own handles do
    assert alice.release_owner() == 4
    assert registry.usage("alice").sessions == 0


def test_control_an_inserted_clone_is_claimed_by_the_service(pair) -> None:
    engine, prefix = pair
    registry = engine.deps.registry
    alice_engine = EngineClient(engine.address, owner="alice")
    alice = PrefixClient(prefix.address, owner="alice")
    session = (
        alice_engine.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    assert alice_engine.describe(session)[0] == len(PROMPT)  # the pending token is not committed
    assert alice.insert(PROMPT, session)
    (entry,) = prefix.cache.entries()
    assert registry.payer_of(entry.snapshot) == SERVICE  # claimed as it was stored
    assert registry.usage("alice").sessions == 1  # only her own session
    assert registry.usage(SERVICE).sessions == 1
    # and a hand-over the service later stores (through the gateway's capture) is claimed too
    alice.generate(BOB_PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    assert len(prefix.cache) == 2
    assert all(registry.payer_of(e.snapshot) == SERVICE for e in prefix.cache.entries())
    assert registry.usage("alice").sessions == 1
