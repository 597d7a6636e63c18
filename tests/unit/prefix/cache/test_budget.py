"""The prefix cache's budget (issue 10 item 3) against the fakes: entries AND positions, room reserved
for snapshots on their way, the share of the engine the gateway derives from its limits, and what a
live request that finds the engine full does (evict one entry by the policy, retry once)."""

from __future__ import annotations

import pytest

from engine_service.api.answers import CloneRefusal
from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument, QuotaExceeded, ResourceExhausted
from engine_service.api.stream_events import Snapshot, SnapshotKind, Started, Tokens
from prefix_service.cache.budget import Reservation, engine_budget
from prefix_service.cache.outcomes import InsertRefusal, MissReason
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from tests.unit.prefix.fake_engine import FakeEngine, FakeStream, done_event

NS = "app"


def tokens(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def store(backend, cache: PrefixCache, key, **kwargs) -> None:
    assert cache.insert(NS, key, backend.open(key), **kwargs).stored


# -- the cache's budget ------------------------------------------------------------------------------


def test_positions_bound_weighs_long_entries_more(backend) -> None:
    cache = PrefixCache(backend, max_entries=10, max_positions=100)
    for i in range(5):
        store(backend, cache, tokens(1000 * (i + 1), 10))  # 5 short entries: 50 positions
    long = tokens(9000, 80)
    store(backend, cache, long)  # 130 > 100: the 3 least recent short ones go (entries alone would fit)
    assert [e.tokens for e in cache.entries()] == [tokens(4000, 10), tokens(5000, 10), long]
    stats = cache.stats()
    assert (stats.entries, stats.positions, stats.max_positions, stats.evictions) == (3, 100, 100, 3)
    assert len(backend.live) == 3  # the victims' snapshots were released


def test_an_entry_longer_than_the_positions_bound_is_refused_and_released(backend) -> None:
    cache = PrefixCache(backend, max_entries=4, max_positions=50)
    store(backend, cache, tokens(10, 20))
    snapshot = backend.open(tokens(100, 51))
    assert cache.insert(NS, tokens(100, 51), snapshot).reason is InsertRefusal.OVER_BUDGET
    assert snapshot.closed and len(cache) == 1 and cache.stats().refusals == {"over_budget": 1}


def test_set_budget_and_evict_follow_the_policy(backend) -> None:
    cache = PrefixCache(backend, max_entries=8)
    for i in range(6):
        store(backend, cache, tokens(100 * (i + 1), 5))
    cache.lookup(NS, tokens(100, 5))  # the oldest becomes the most recent
    assert cache.set_budget(4, 0) == 2  # shrinking evicts the least recently used
    assert [e.tokens[0] for e in cache.entries()] == [100, 400, 500, 600]
    assert cache.evict(1) == 1 and [e.tokens[0] for e in cache.entries()] == [100, 500, 600]
    assert cache.set_budget(4, 10) == 1  # 15 positions > 10
    assert cache.positions == 10 and cache.max_entries == 4
    assert cache.evict(5) == 2 and len(cache) == 0 and cache.evict(1) == 0
    with pytest.raises(InvalidArgument, match="max_positions"):
        cache.set_budget(4, -1)


def test_a_reservation_makes_room_before_the_snapshot_exists(backend) -> None:
    cache = PrefixCache(backend, max_entries=2, max_positions=30)
    store(backend, cache, tokens(100, 10))
    store(backend, cache, tokens(200, 10))
    room = cache.reserve(NS, tokens(300, 10))
    assert isinstance(room, Reservation) and [e.tokens[0] for e in cache.entries()] == [200]  # LRU evicted
    # the reservation counts like an entry: a second one evicts the last entry, a third finds no room
    second = cache.reserve(NS, tokens(400, 15))
    assert isinstance(second, Reservation) and len(cache) == 0
    assert cache.reserve(NS, tokens(500, 5)) is InsertRefusal.OVER_BUDGET
    assert cache.insert(NS, tokens(300, 10), backend.open(tokens(300, 10)), reservation=room).stored
    second.release()
    second.release()  # idempotent
    store(backend, cache, tokens(600, 20))  # 10 + 20 = 30 positions: fits without evicting
    assert len(cache) == 2 and cache.stats().evictions == 2
    assert cache.reserve(NS, tokens(700, 31)) is InsertRefusal.OVER_BUDGET  # can never fit
    assert PrefixCache(backend, 0).reserve(NS, tokens(1, 3)) is InsertRefusal.DISABLED


def test_reserving_never_evicts_for_a_newcomer_the_policy_ranks_lower_or_a_duplicate(backend) -> None:
    cache = PrefixCache(backend, max_entries=1, policy="priority")
    store(backend, cache, tokens(100, 10), metadata={"priority": "5"})
    assert cache.reserve(NS, tokens(200, 10), {"priority": "0"}) is InsertRefusal.EVICTED
    assert cache.reserve(NS, tokens(100, 10)) is InsertRefusal.DUPLICATE  # refreshed, no room taken
    assert [e.tokens[0] for e in cache.entries()] == [100]
    assert isinstance(cache.reserve(NS, tokens(300, 10), {"priority": "9"}), Reservation)
    assert len(cache) == 0  # a higher-priority newcomer takes the room


def test_engine_budget_is_the_smallest_of_config_share_and_quota() -> None:
    # share 0.5 of an engine of 32 sessions x 2048 positions: 16 entries, 32768 positions
    assert engine_budget(0.5, 64, 0, engine_max_sessions=32, engine_max_session_tokens=2048) == (16, 32768)
    assert engine_budget(0.5, 8, 1000, engine_max_sessions=32, engine_max_session_tokens=2048) == (8, 1000)
    assert engine_budget(
        0.25,
        64,
        0,
        engine_max_sessions=12,
        engine_max_session_tokens=256,
        quota_sessions=2,
        quota_positions=300,
    ) == (2, 300)
    assert engine_budget(1.0, 64, 0, engine_max_sessions=0, engine_max_session_tokens=0) == (
        64,
        0,
    )  # no limits said
    assert engine_budget(0.5, 64, 0, engine_max_sessions=1, engine_max_session_tokens=64) == (
        0,
        32,
    )  # no room


def test_engine_budget_in_bytes_takes_the_share_of_the_engines_k_v_positions() -> None:
    # SmolLM2 at float16 on a 24 GiB machine: 279,620 positions of 23,040 bytes, 256 sessions
    engine = {"engine_max_sessions": 256, "engine_max_session_tokens": 2048, "engine_max_positions": 279620}
    assert engine_budget(0.5, 4096, 0, **engine) == (128, 139810)  # half the sessions, half the positions
    per = {**engine, "kv_bytes_per_position": 23040}
    assert engine_budget(0.5, 4096, 0, **per, max_cache_mib=1024) == (128, 1024 * 2**20 // 23040)  # 46,603
    assert engine_budget(0.5, 4096, 0, **per, max_cache_mib=8192) == (128, 139810)  # the share binds
    assert engine_budget(0.5, 4096, 40000, **per, max_cache_mib=1024) == (128, 40000)  # the flag binds
    # an engine that does not report bytes: --max_cache_mib cannot apply; sessions x tokens as before
    assert engine_budget(
        0.5, 4096, 0, engine_max_sessions=32, engine_max_session_tokens=2048, max_cache_mib=1
    ) == (
        16,
        32768,
    )
    assert engine_budget(1.0, 8, 0, **{**per, "kv_bytes_per_position": 2**21}, max_cache_mib=1) == (
        8,
        1,
    )  # >= 1


# -- the gateway ---------------------------------------------------------------------------------------


def request(prompt, **kwargs) -> GatewayRequest:
    return GatewayRequest(NS, prompt, GenConfig(max_new_tokens=3), **kwargs)


def test_the_gateway_caps_the_cache_at_its_share_of_the_engine() -> None:
    engine = FakeEngine(max_session_tokens=100)
    engine.max_sessions = 12
    gateway = Gateway(PrefixCache(engine, max_entries=64), engine, engine_share=0.5)
    for i in range(10):
        list(gateway.generate(request(tokens(50 * (i + 1), 20)), CallContext("alice")))
    stats = gateway.stats()
    assert (stats.cache.max_entries, stats.cache.max_positions, stats.engine_share) == (6, 600, 0.5)
    assert stats.cache.entries == 6 and stats.cache.positions == 120 and stats.cache.evictions == 4
    with pytest.raises(InvalidArgument, match="engine_share"):
        Gateway(PrefixCache(engine, 4), engine, engine_share=0)


@pytest.mark.parametrize("max_cache_mib", [0, 1])
def test_the_gateway_bounds_the_cache_in_bytes_and_reports_them(max_cache_mib) -> None:
    engine = FakeEngine(max_session_tokens=100)
    engine.max_sessions, engine.max_positions, engine.kv_bytes_per_position = 64, 500, 10_000
    gateway = Gateway(
        PrefixCache(engine, max_entries=64), engine, engine_share=0.5, max_cache_mib=max_cache_mib
    )
    for i in range(10):
        list(gateway.generate(request(tokens(50 * (i + 1), 20)), CallContext("alice")))
    c = gateway.stats().cache
    # 1 MiB / 10,000 bytes = 104 positions: five 20-position entries; control (0): half of 500 holds all ten
    bound, held = (104, 100) if max_cache_mib else (250, 200)
    assert (c.max_entries, c.max_positions, c.positions, c.entries) == (32, bound, held, held // 20)
    assert (c.bytes_held, c.max_bytes) == (held * 10_000, bound * 10_000)
    with pytest.raises(InvalidArgument, match="max_cache_mib"):
        Gateway(PrefixCache(engine, 4), engine, max_cache_mib=-1)


class FullEngine(FakeEngine):
    """Refuses the next ``refusals`` Generate calls as a full engine (or ``error``) would."""

    def __init__(self, error: ResourceExhausted) -> None:
        super().__init__()
        self.refusals, self.error = 0, error

    def generate(self, request):
        if self.refusals:
            self.refusals -= 1
            self.requests.append(request)
            raise self.error
        return super().generate(request)


def filled(engine: FakeEngine, pressure_retry: bool = True) -> Gateway:
    gateway = Gateway(PrefixCache(engine, max_entries=8), engine, pressure_retry=pressure_retry)
    for i in range(3):
        list(gateway.generate(request(tokens(100 * (i + 1), 20)), CallContext("alice")))
    return gateway


def test_a_live_request_that_finds_the_engine_full_evicts_one_entry_and_retries_once() -> None:
    engine = FullEngine(ResourceExhausted("no free session: 8 resident, max_sessions=8"))
    gateway = filled(engine)
    engine.refusals = 1
    events = list(gateway.generate(request(tokens(100, 20)), CallContext("bob")))  # a cached prompt
    assert isinstance(events[0], Started) and isinstance(events[1], Tokens)
    stats = gateway.stats()
    assert (stats.pressure_evictions, stats.pressure_retries, stats.cache.entries) == (1, 1, 2)
    engine.refusals = 2  # still full after the retry: the caller gets the error, after one eviction
    with pytest.raises(ResourceExhausted):
        gateway.generate(request(tokens(100, 20)), CallContext("bob"))
    assert gateway.stats().pressure_retries == 2
    assert not [s for s in engine.live if s.position == 19]  # every matched clone was closed


def test_a_caller_over_its_own_quota_evicts_nothing() -> None:
    engine = FullEngine(QuotaExceeded("bob", 2, "sessions", "owner_max_sessions", 2))
    gateway = filled(engine)
    engine.refusals = 1
    with pytest.raises(ResourceExhausted, match="owner 'bob' holds 2 sessions, owner_max_sessions=2"):
        gateway.generate(request(tokens(100, 20)), CallContext("bob"))
    assert gateway.stats().pressure_evictions == 0 and len(gateway.cache) == 3


def test_negative_control_without_the_retry_the_full_engine_fails_the_request() -> None:
    engine = FullEngine(ResourceExhausted("no free session"))
    gateway = filled(engine, pressure_retry=False)
    engine.refusals = 1
    with pytest.raises(ResourceExhausted):
        gateway.generate(request(tokens(100, 20)), CallContext("bob"))
    assert len(gateway.cache) == 3


def test_a_lookup_refused_for_room_on_a_full_engine_evicts_and_retries() -> None:
    engine = FakeEngine()
    gateway = filled(engine)
    target = tokens(300, 20)  # the most recently stored: the LRU victim is another entry
    engine.capacity = engine.max_sessions = len(engine.live)  # full: every clone is refused
    lookup = gateway.lookup(NS, target, CallContext("bob"))
    assert lookup.outcome.reused == len(target) - 1 and gateway.stats().pressure_evictions == 1
    engine.max_sessions = 100  # a boundary refusal on an engine with room: nothing is evicted
    engine.capacity = len(engine.live)
    assert gateway.lookup(NS, target, CallContext("bob")).outcome.reason is MissReason.BOUNDARY_REFUSED
    assert gateway.stats().pressure_evictions == 1


def test_a_capture_refused_for_quota_is_the_callers_and_reclaims_nothing() -> None:
    """A gateway capture counts against its caller until the service claims it (issue 21 item 6), so
    a QUOTA refusal is the caller's quota: counted, and nothing of the service's reclaimed (its
    unknown handles include other callers' captures on their way, which a ReleaseOwner would take;
    the service's own quota is met at the claim: test_quotas.py)."""

    class QuotaEngine(FakeEngine):
        def generate(self, request):
            self.requests.append(request)
            session = self.open(request.tokens)
            return FakeStream(
                [
                    Started(session, 0, len(request.tokens)),
                    Snapshot(
                        None, len(request.tokens), SnapshotKind.PROMPT, "quota", reason=CloneRefusal.QUOTA
                    ),
                    Tokens((500,), "x"),
                    done_event(len(request.tokens), 0),
                ]
            )

    engine = QuotaEngine()
    gateway = Gateway(PrefixCache(engine, max_entries=8), engine)
    list(gateway.generate(request(tokens(100, 20)), CallContext("alice")))
    stats = gateway.stats()
    assert engine.reclaims == 0 and stats.reclaimed == 0
    assert stats.cache.refusals == {"quota": 1} and stats.cache.entries == 0
