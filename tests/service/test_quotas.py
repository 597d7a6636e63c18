"""No owner can hold the engine hostage (issue 10 item 5): per-owner quotas of resident sessions and
positions, over real gRPC servers on port 0, with negative controls (no quotas: the other owner fails).

An owner's resident sessions are every session it has, live or held: a fresh session for the length
of its call (and after it, kept), kept sessions, clones, snapshots. A clone or snapshot may go to
another owner only to or from a persistent owner (the prefix service), and counts against the owner
receiving it.
"""

from __future__ import annotations

import grpc
import pytest

from clients.engine_client import EngineClient, Started
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    QuotaExceeded,
    ResourceExhausted,
)
from engine_service.api.owners import NO_QUOTA, OwnerQuota
from engine_service.serving.auth import OWNER_METADATA_KEY
from engine_service.sessions.handles import HandleRegistry, engine_quotas
from protos import engine_pb2 as pb
from tests.service.helpers import PROMPT, wait_for

MAX_SESSIONS = 8
MAX_SESSION_TOKENS = 256
QUOTA, PERSISTENT = engine_quotas(
    MAX_SESSIONS, MAX_SESSION_TOKENS
)  # the CLI's defaults: 2 sessions, 256 positions


def hog(engine, owner: str = "mallory", rounds: int = 12) -> tuple[list[str], list[ResourceExhausted]]:
    """Open sessions in a loop as ``owner``: a kept generation, then a clone of it, ``rounds`` times
    (bounded). Returns (handles held, refusals)."""
    client = EngineClient(engine.address, owner=owner)
    held, refusals = [], []
    for _ in range(rounds):
        try:
            session = (
                client.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
                .collect()
                .started.session
            )
            held.append(session)
            clone = client.clone(session, len(PROMPT))
            if clone is not None:
                held.append(clone)
        except ResourceExhausted as exc:
            refusals.append(exc)
    return held, refusals


def test_defaults_leave_room_for_others() -> None:
    assert engine_quotas(MAX_SESSIONS, MAX_SESSION_TOKENS) == (OwnerQuota(2, 256), OwnerQuota(4, 1024))
    assert engine_quotas(32, 2048) == (OwnerQuota(8, 8192), OwnerQuota(16, 32768))
    assert engine_quotas(2, 64) == (OwnerQuota(1, 32), OwnerQuota(1, 64))  # at least one session each
    assert engine_quotas(8, 64, owner_max_sessions=0, persistent_owner_share=0) == (
        OwnerQuota(0, 0),
        NO_QUOTA,
    )
    with pytest.raises(InvalidArgument, match="persistent_owner_share"):
        engine_quotas(8, 64, persistent_owner_share=1.5)


def test_one_owner_opening_sessions_in_a_loop_cannot_make_another_fail(engine_factory) -> None:
    engine = engine_factory(max_sessions=MAX_SESSIONS, quota=QUOTA, persistent_quota=PERSISTENT)
    held, refusals = hog(engine)
    assert len(held) == 2 and len(refusals) >= 10
    assert all(str(r) == "owner 'mallory' holds 2 sessions, owner_max_sessions=2" for r in refusals), refusals
    # typed over the wire (an ErrorInfo detail), not parsed from the message
    assert all(
        isinstance(r, QuotaExceeded)
        and (r.owner, r.unit, r.held, r.limit, r.quota) == ("mallory", "sessions", 2, 2, "owner_max_sessions")
        for r in refusals
    )
    assert engine.deps.registry.count("mallory") == 2 and engine.runner.resident_sessions == 2
    bob = EngineClient(engine.address, owner="bob")
    assert bob.generate(PROMPT, config=GenConfig(max_new_tokens=2)).collect().done.finish_reason == "length"
    kept = (
        bob.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True).collect().started.session
    )
    assert bob.clone(kept, 40) is not None  # bob has his own quota
    info = bob.info()
    assert (info.caller.sessions, info.caller.quota.max_sessions, info.client_quota.max_sessions) == (2, 2, 2)
    assert info.persistent_quota.max_sessions == 4 and not info.caller.persistent


def test_negative_control_without_quotas_the_loop_takes_every_slot(engine_factory) -> None:
    engine = engine_factory(max_sessions=MAX_SESSIONS)
    held, refusals = hog(engine)
    assert len(held) == MAX_SESSIONS and refusals  # the engine's own limit stops mallory, at the end
    with pytest.raises(ResourceExhausted):
        EngineClient(engine.address, owner="bob").generate(
            PROMPT, config=GenConfig(max_new_tokens=2)
        ).collect()


def test_a_live_generation_counts_and_the_positions_quota_is_named(engine_factory) -> None:
    engine = engine_factory(max_sessions=MAX_SESSIONS, max_session_tokens=4096, quota=OwnerQuota(2, 0))
    mallory = EngineClient(engine.address, owner="mallory")
    kept = (
        mallory.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    stream = mallory.generate(
        PROMPT, config=GenConfig(max_new_tokens=3000), ignore_eos=True
    )  # live: holds a session
    events = iter(stream)
    assert isinstance(next(events), Started)
    with pytest.raises(ResourceExhausted, match="owner 'mallory' holds 2 sessions, owner_max_sessions=2"):
        mallory.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    stream.cancel()
    assert wait_for(lambda: engine.deps.registry.count("mallory") == 1)
    assert (
        mallory.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect().done is not None
    )  # room again
    mallory.close(kept)

    engine = engine_factory(max_sessions=MAX_SESSIONS, quota=QUOTA)  # 256 positions
    mallory = EngineClient(engine.address, owner="mallory")
    kept = (
        mallory.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )  # 90 positions
    # a generation reserves input + min(max_new_tokens, growth) when it starts (growth: 32 positions
    # on 256-position sessions; it grows later, tests/service/test_reservations.py): 170 + 32 = 202
    # would fit alone, not with 90 held
    longer = (PROMPT * 2)[:170]
    with pytest.raises(
        ResourceExhausted,
        match=r"owner 'mallory' holds 90 positions and needs 202 more, "
        r"owner_max_positions=256",
    ):
        mallory.generate(longer, config=GenConfig(max_new_tokens=150)).collect()
    short = (
        mallory.generate(PROMPT[:20], config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    # continuing a held session reserves its position + the pending token + input + min(max_new_tokens,
    # growth), at most the session: 91 + 150 + 32 > 256, 166 more than the 90 it weighs
    with pytest.raises(
        ResourceExhausted, match=r"holds 110 positions and needs 166 more, owner_max_positions=256"
    ):
        mallory.generate(longer[:150], session=kept, config=GenConfig(max_new_tokens=163)).collect()
    assert (
        mallory.generate([65, 66], session=kept, config=GenConfig(max_new_tokens=20)).collect().done
        is not None
    )
    held = mallory.describe(kept)[0] + mallory.describe(short)[0]
    assert engine.deps.registry.usage("mallory").positions == held  # held sessions weigh their positions


def test_clones_go_to_another_owner_only_through_a_persistent_owner(engine_factory) -> None:
    engine = engine_factory(max_sessions=MAX_SESSIONS, quota=QUOTA, persistent_quota=PERSISTENT)
    mallory = EngineClient(engine.address, owner="mallory")
    session = (
        mallory.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    with pytest.raises(InvalidArgument, match="new_owner 'bob'"):  # parking sessions under another client
        mallory.clone(session, 40, new_owner="bob")
    request = pb.GenerateRequest(
        tokens=pb.TokenIds(ids=PROMPT), capture=pb.CaptureOptions(prompt_snapshot=True, snapshot_owner="bob")
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(mallory.stub.Generate(request, metadata=((OWNER_METADATA_KEY, "mallory"),)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "capture.snapshot_owner 'bob'" in refused.value.details()
    # a clone handed to the prefix service counts against mallory's quota until the service claims it
    # (as it stores it): she cannot fill the service's budget with sessions it never asked for
    assert mallory.clone(session, 40, new_owner="prefix-service")
    assert engine.deps.registry.usage("mallory").sessions == 2
    with pytest.raises(ResourceExhausted, match="owner 'mallory' holds 2 sessions, owner_max_sessions=2"):
        mallory.clone(session, 41, new_owner="prefix-service")


def test_the_prefix_service_reclaims_sessions_it_does_not_know(engine_factory, prefix_factory) -> None:
    # The prefix service's engine budget is full of sessions it never heard of (an earlier process of
    # the service left them; a client's hand-overs count against the client until claimed); its next
    # insert and gateway capture still store (it releases the handles it does not know).
    engine = engine_factory(max_sessions=MAX_SESSIONS, quota=QUOTA, persistent_quota=PERSISTENT)
    prefix = prefix_factory(engine.address)
    earlier = EngineClient(engine.address, owner="prefix-service")

    def fill(count: int) -> None:
        session = (
            earlier.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
            .collect()
            .started.session
        )
        for i in range(count - 1):
            assert earlier.clone(session, 40 + i)

    fill(4)
    bob = PrefixClient(prefix.address, owner="bob")
    bob.generate(
        PROMPT, config=GenConfig(max_new_tokens=1)
    ).collect()  # claiming its snapshot finds no room: reclaim
    stats = bob.stats()
    assert (stats.reclaimed, stats.entries, stats.refusals) == (4, 1, {})
    assert (
        bob.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect().done.reused_positions
        == len(PROMPT) - 1
    )
    assert engine.deps.registry.count("prefix-service") == 1 == prefix.server.deps.backend.sessions.held()
    # the Insert path: fill again, then bob's insert reclaims and stores
    fill(3)
    bob_engine = EngineClient(engine.address, owner="bob")
    other = [ord(c) for c in "Another prompt for an insert."]
    kept = (
        bob_engine.generate(other, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    handed = bob_engine.clone(kept, len(other))
    bob_engine.close(kept)  # the service's clone counts in bob's quota (2 sessions) until claimed
    result = bob.insert_detailed(other, handed)
    assert result.stored, result
    assert bob.stats().reclaimed == 7 and engine.deps.registry.count("prefix-service") == 2


def test_a_prefix_service_whose_owner_the_engine_does_not_keep_refuses_to_start(
    engine, prefix_factory
) -> None:
    with pytest.raises(FailedPrecondition, match="--persistent_owner short-lived"):
        prefix_factory(engine.address, owner="short-lived")


def test_registry_reservations_count_and_never_resolve() -> None:
    registry: HandleRegistry[str] = HandleRegistry(
        quota=OwnerQuota(2, 100), persistent_owners=frozenset({"svc"}), persistent_quota=OwnerQuota(1, 0)
    )
    pending = registry.reserve("alice", 60)
    with pytest.raises(NotFound):
        registry.resolve(pending, "alice")
    with pytest.raises(
        QuotaExceeded, match="owner 'alice' holds 60 positions and needs 50 more, owner_max_positions=100"
    ):
        registry.register("v", "alice", 50)
    assert registry.fill(pending, "value") and registry.resolve(pending, "alice") == "value"
    registry.register("w", "alice", 40)
    with pytest.raises(QuotaExceeded, match="owner 'alice' holds 2 sessions, owner_max_sessions=2"):
        registry.reserve("alice")
    registry.weigh(pending, 10)
    with pytest.raises(QuotaExceeded):
        registry.weigh(pending, 70, check=True)
    assert registry.usage("alice").positions == 50
    registry.register("s", "svc")
    with pytest.raises(QuotaExceeded, match="persistent_owner_max_sessions=1"):
        registry.register("t", "svc")
    in_flight = registry.reserve("bob")
    assert [r.value for r in registry.release_owner("alice", keep=[pending])] == ["w"]
    assert registry.release_owner("bob") == [] and registry.fill(in_flight, "late")  # not released mid-call
    late = registry.reserve("bob")
    assert sorted(r.value for r in registry.release_all()) == ["late", "s", "value"]
    assert not registry.fill(late, "x")  # shutdown dropped the reservation: its caller closes the value


def test_a_caller_over_its_quota_is_refused_by_the_gateway_and_evicts_nothing(
    engine_factory, prefix_factory
) -> None:
    engine = engine_factory(max_sessions=MAX_SESSIONS, quota=QUOTA, persistent_quota=PERSISTENT)
    prefix = prefix_factory(engine.address)
    alice = PrefixClient(prefix.address, owner="alice")
    alice.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()  # cached
    bob_engine, bob = EngineClient(engine.address, owner="bob"), PrefixClient(prefix.address, owner="bob")
    held = [
        bob_engine.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
        for _ in range(2)
    ]
    with pytest.raises(ResourceExhausted, match="owner 'bob' holds 2 sessions, owner_max_sessions=2"):
        bob.lookup(PROMPT)  # the clone would be bob's
    with pytest.raises(ResourceExhausted, match="owner 'bob' holds 2 sessions, owner_max_sessions=2"):
        bob.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()  # the live session would be bob's
    stats = bob.stats()
    assert (stats.entries, stats.pressure_evictions) == (1, 0)  # his quota: evicting would not help him
    bob_engine.close(held[0])
    assert (
        bob.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect().done.reused_positions
        == len(PROMPT) - 1
    )


def test_a_reclaim_leaves_captures_on_their_way_to_the_service(engine_factory, prefix_factory) -> None:
    # A hand-over the service has not read yet (a gateway capture still in its stream) is charged to its
    # caller: the service reclaiming its own quota must not close it, or that caller's insert is lost
    # (it was: one insert of 200 under load). Negative control: a plain ReleaseOwner takes it.
    engine = engine_factory(max_sessions=MAX_SESSIONS, quota=QUOTA, persistent_quota=PERSISTENT)
    prefix = prefix_factory(engine.address)
    service = EngineClient(engine.address, owner="prefix-service")
    service.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True).collect()  # forgotten
    bob = EngineClient(engine.address, owner="bob")
    kept = (
        bob.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True).collect().started.session
    )
    on_its_way = bob.clone(kept, len(PROMPT), new_owner="prefix-service")  # paid by bob until claimed
    assert prefix.server.deps.backend.reclaim() == 1  # the forgotten session only
    assert engine.deps.registry.payer_of(on_its_way) == "bob"
    assert service.release_owner() == 1 and engine.deps.registry.payer_of(on_its_way) is None
