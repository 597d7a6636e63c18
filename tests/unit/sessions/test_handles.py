"""HandleRegistry: owners, quotas, payers and expiry, each against numbers worked out by hand."""

from __future__ import annotations

import pytest

from engine_service.api.errors import InvalidArgument, NotFound, QuotaExceeded, ResourceExhausted
from engine_service.api.handle_names import new_handle, new_instance_id
from engine_service.api.owners import NO_QUOTA, OwnerQuota
from engine_service.sessions.handles import HandleRegistry, engine_quotas
from tests.unit.sessions.conftest import PERSISTENT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def registry(**kw) -> HandleRegistry[str]:
    return HandleRegistry(persistent_owners=frozenset({PERSISTENT}), **kw)


def test_only_the_owner_resolves_and_every_miss_reads_the_same() -> None:
    reg = registry()
    handle = reg.register("alice's", "alice")
    assert reg.resolve(handle, "alice") == "alice's"
    misses = []
    for probe, owner in [(handle, "bob"), ("not-a-handle", "alice"), (new_handle(reg.instance_id), "alice")]:
        with pytest.raises(NotFound) as info:
            reg.resolve(probe, owner)
        misses.append(str(info.value).replace(repr(probe), "<h>"))
    assert misses == ["unknown session handle <h>"] * 3  # a foreign handle looks like an unknown one
    with pytest.raises(NotFound, match="the engine restarted"):
        reg.resolve(new_handle(new_instance_id()), "alice")


def test_the_sessions_quota_refuses_the_next_session_of_that_owner_only() -> None:
    reg = registry(quota=OwnerQuota(max_sessions=2))
    reg.register("a1", "alice")
    reg.reserve("alice")  # a pending reservation counts too
    with pytest.raises(QuotaExceeded) as info:
        reg.register("a3", "alice")
    exc = info.value
    assert (exc.owner, exc.held, exc.unit, exc.quota, exc.limit) == (
        "alice",
        2,
        "sessions",
        "owner_max_sessions",
        2,
    )
    reg.register("b1", "bob")  # negative control: another owner still has room
    assert reg.usage("alice").sessions == 2 and reg.usage("bob").sessions == 1


def test_the_positions_quota_refuses_a_weight_past_it_and_extend_takes_what_is_left() -> None:
    reg = registry(quota=OwnerQuota(max_positions=100))
    a = reg.register("a", "alice", positions=60)
    with pytest.raises(QuotaExceeded) as info:
        reg.register("b", "alice", positions=41)
    assert (info.value.held, info.value.needed, info.value.quota) == (60, 41, "owner_max_positions")
    b = reg.register("b", "alice", positions=30)
    assert reg.extend(b, 80) == 40  # 100 - 60 - 30 = 10 more fit
    assert reg.extend(b, 20) == 40  # never lowers
    with pytest.raises(QuotaExceeded):
        reg.weigh(a, 61, check=True)
    reg.weigh(a, 10, check=True)  # lowering always fits
    assert reg.usage("alice").positions == 50


def test_the_engines_positions_bound_holds_across_owners_and_a_claim_moves_without_counting_twice() -> None:
    reg = registry(max_positions=100)
    reg.register("a", "alice", positions=60)
    with pytest.raises(ResourceExhausted, match="hold 60 positions and this needs 41 more") as info:
        reg.register("b", "bob", positions=41)  # bob has no quota: the engine's bound refuses
    assert not isinstance(info.value, QuotaExceeded) and "max_positions=100" in str(info.value)
    given = reg.reserve(PERSISTENT, 10, payer="alice")
    reg.fill(given, "snapshot")
    b = reg.register("b", "bob", positions=25)
    assert reg.extend(b, 80) == 30  # 100 - 60 - 10 - 25 = 5 more fit: the bound is full
    reg.claim(given, PERSISTENT)  # the charge moves between payers: nothing new is held
    assert reg.payer_of(given) == PERSISTENT
    with pytest.raises(ResourceExhausted):
        reg.weigh(b, 31, check=True)
    reg.discard(given)
    reg.weigh(b, 40, check=True)  # room again: 60 + 40
    assert registry(max_positions=0).register("c", "carol", positions=10**9)  # 0: no bound
    with pytest.raises(InvalidArgument, match="max_positions"):
        registry(max_positions=-1)


def test_a_hand_over_counts_against_the_giver_until_the_receiver_claims_it() -> None:
    reg = registry(quota=OwnerQuota(max_sessions=2), persistent_quota=OwnerQuota(max_sessions=1))
    given = reg.reserve(PERSISTENT, 5, payer="alice")
    assert reg.fill(given, "snapshot")
    assert (reg.usage("alice").sessions, reg.usage(PERSISTENT).sessions) == (1, 0)
    reg.claim(given, PERSISTENT)
    assert (reg.usage("alice").sessions, reg.usage(PERSISTENT).sessions) == (0, 1)
    assert reg.payer_of(given) == PERSISTENT
    second = reg.reserve(PERSISTENT, 5, payer="alice")
    reg.fill(second, "another")
    with pytest.raises(QuotaExceeded):  # the persistent budget holds one: the claim changes nothing
        reg.claim(second, PERSISTENT)
    assert reg.payer_of(second) == "alice"


def test_idle_client_handles_expire_but_pinned_and_persistent_ones_do_not() -> None:
    clock = Clock()
    reg = registry(idle_timeout_s=10.0, clock=clock)
    idle = reg.register("idle", "alice")
    pinned = reg.register("pinned", "alice")
    reg.pin(pinned, "alice")
    kept = reg.register("kept", PERSISTENT)
    handed = reg.reserve(PERSISTENT, payer="alice")  # unclaimed: expires like alice's own
    reg.fill(handed, "handed")
    clock.now += 9.0
    assert reg.expire_idle() == []  # negative control: not yet
    clock.now += 2.0
    assert sorted(r.value for r in reg.expire_idle()) == ["handed", "idle"]
    assert reg.resolve(pinned, "alice") == "pinned" and reg.resolve(kept, PERSISTENT) == "kept"
    with pytest.raises(NotFound):
        reg.resolve(idle, "alice")


def test_release_owner_takes_its_handles_and_its_unclaimed_hand_overs_except_kept_ones() -> None:
    reg = registry()
    a, b = reg.register("a", "alice"), reg.register("b", "alice")
    handed = reg.reserve(PERSISTENT, payer="alice")
    reg.fill(handed, "handed")
    reg.register("c", "bob")
    assert sorted(r.value for r in reg.release_owner("alice", keep=[b])) == ["a", "handed"]
    assert reg.resolve(b, "alice") == "b" and len(reg) == 2
    with pytest.raises(NotFound):
        reg.resolve(a, "alice")
    assert sorted(r.value for r in reg.release_all()) == ["b", "c"] and len(reg) == 0


def test_release_owner_paid_only_leaves_hand_overs_their_givers_still_pay_for() -> None:
    """A persistent owner freeing its quota: a capture on its way (charged to alice) stays; what it
    claimed and forgot goes. Negative control: without paid_only both go."""
    for paid_only, expected in ((True, ["claimed"]), (False, ["claimed", "on its way"])):
        reg = registry()
        on_its_way = reg.reserve(PERSISTENT, payer="alice")
        reg.fill(on_its_way, "on its way")
        claimed = reg.reserve(PERSISTENT, payer="alice")
        reg.fill(claimed, "claimed")
        reg.claim(claimed, PERSISTENT)
        released = reg.release_owner(PERSISTENT, paid_only=paid_only)
        assert sorted(r.value for r in released) == expected
        if paid_only:
            assert reg.resolve(on_its_way, PERSISTENT) == "on its way"


@pytest.mark.parametrize(
    ("args", "kw", "expected"),
    [
        # a quarter of the sessions; half the positions those sessions could hold; the share for persistent
        ((32, 2048), {}, (OwnerQuota(8, 8192), OwnerQuota(16, 32768))),
        ((3, 100), {}, (OwnerQuota(1, 50), OwnerQuota(1, 150))),  # at least one session each
        ((8, 64), {"owner_max_sessions": 0, "persistent_owner_share": 0}, (OwnerQuota(0, 0), NO_QUOTA)),
        (
            (8, 64),
            {"owner_max_positions": 10, "persistent_owner_share": 1.0},
            (OwnerQuota(2, 10), OwnerQuota(8, 512)),
        ),
    ],
)
def test_engine_quotas(args, kw, expected) -> None:
    assert engine_quotas(*args, **kw) == expected
