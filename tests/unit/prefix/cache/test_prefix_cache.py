"""PrefixCache behaviours ("Prefix cache" in SEED_TESTS.md) against the fake backend.

Every hit is checked against the tokens the returned session really holds (the fake's token list),
which the cache never sees: a wrong ``reused`` or a clone of the wrong entry fails the comparison.
"""

from __future__ import annotations

import pytest

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.prefix_cache import Match, PrefixCache
from prefix_service.cache.retention import make_policy
from tests.unit.prefix.fakes import FakeBackend

NS = "app"
PROMPT = tuple(range(10, 20))  # 10 tokens


def stored(backend: FakeBackend, cache: PrefixCache, tokens, **kwargs) -> object:
    """Insert a fresh snapshot holding ``tokens``; returns the snapshot handle."""
    snapshot = backend.open(tokens)
    assert cache.insert(NS, tokens, snapshot, **kwargs).stored
    return snapshot


def assert_hit(match: Match | None, request, reused: int) -> None:
    assert match is not None
    assert match.reused == reused
    assert match.session.tokens == tuple(request[:reused])  # what the engine session really holds
    assert match.session.position == reused


@pytest.mark.parametrize(
    ("request_tokens", "reused"),
    [
        (PROMPT, 9),  # equal: replay the final token
        (PROMPT[:6], 5),  # shorter
        (PROMPT + (99, 98), 10),  # extended
        (PROMPT[:4] + (77, 78, 79), 4),  # diverging
    ],
)
def test_reused_is_common_prefix_capped_at_len_minus_one(backend, cache, request_tokens, reused):
    stored(backend, cache, PROMPT)
    assert_hit(cache.lookup(NS, request_tokens).match, request_tokens, reused)


@pytest.mark.parametrize("request_tokens", [(), (10,), (11, 12, 13), (10 + 2**32,)])
def test_empty_one_token_and_first_token_mismatch_miss(backend, cache, request_tokens):
    stored(backend, cache, PROMPT)
    assert cache.lookup(NS, request_tokens).match is None
    assert cache.stats().misses == 1 and cache.stats().hits == 0


def test_lookup_returns_independent_session_owned_by_caller(backend, cache):
    snapshot = stored(backend, cache, PROMPT)
    match = cache.lookup(NS, PROMPT + (1,)).match
    match.session.extend((55, 56))  # the caller's generation
    cache.backend.close(match.session)
    assert snapshot.tokens == PROMPT and backend.valid(snapshot)
    assert_hit(cache.lookup(NS, PROMPT + (1,)).match, PROMPT + (1,), 10)


def test_branches_survive_source_closure_and_snapshot_eviction(backend):
    cache = PrefixCache(backend, max_entries=1)
    source = backend.open(PROMPT + (1, 2))
    snapshot = backend.clone(source, len(PROMPT))
    backend.close(source)
    assert cache.insert(NS, PROMPT, snapshot).stored
    branch = cache.lookup(NS, PROMPT + (5,)).match.session
    stored(backend, cache, (1, 2, 3))  # evicts the PROMPT snapshot
    assert snapshot.closed
    assert backend.valid(branch) and branch.tokens == PROMPT
    assert backend.clone(branch, 4).tokens == PROMPT[:4]


def test_longest_prefix_beats_more_recent_shorter(backend, cache):
    stored(backend, cache, PROMPT[:8])
    stored(backend, cache, PROMPT[:4] + (7, 7))  # more recent, shares less
    assert_hit(cache.lookup(NS, PROMPT).match, PROMPT, 8)


def test_equal_lengths_prefer_most_recently_used_and_hits_refresh(backend, cache):
    a = stored(backend, cache, PROMPT[:5] + (1, 1))
    b = stored(backend, cache, PROMPT[:5] + (2, 2))
    request = PROMPT[:5] + (3, 3)  # shares 5 with both
    assert backend.clone_calls == []
    cache.lookup(NS, request)
    assert backend.clone_calls[-1] == (b.id, 5)  # b is the most recent
    cache.lookup(NS, PROMPT[:5] + (1, 1, 9))  # hits a, refreshing it
    cache.lookup(NS, request)
    assert backend.clone_calls[-1] == (a.id, 5)


def test_hit_refreshes_recency_before_eviction(backend):
    cache = PrefixCache(backend, max_entries=2)
    a = stored(backend, cache, (1, 2, 3))
    b = stored(backend, cache, (4, 5, 6))
    assert cache.lookup(NS, (1, 2, 3, 4)).match is not None  # a is now the most recent
    stored(backend, cache, (7, 8, 9))
    assert b.closed and not a.closed
    assert cache.stats().evictions == 1


def test_duplicate_insert_refreshes_and_releases_new_snapshot(backend):
    cache = PrefixCache(backend, max_entries=2)
    first = stored(backend, cache, (1, 2, 3))
    stored(backend, cache, (4, 5, 6))
    again = backend.open((1, 2, 3))
    assert not cache.insert(NS, (1, 2, 3), again).stored
    assert again.closed and not first.closed and len(cache) == 2
    assert cache.stats().refusals["duplicate"] == 1
    stored(backend, cache, (7, 8, 9))  # (4,5,6) is now the oldest
    assert not first.closed
    assert [e.tokens for e in cache.entries()] == [(1, 2, 3), (7, 8, 9)]


def test_disabled_cache_releases_without_cloning(backend):
    cache = PrefixCache(backend, max_entries=0)
    snapshot = backend.open(PROMPT)
    assert not cache.insert(NS, PROMPT, snapshot).stored
    assert snapshot.closed and backend.clone_calls == [] and len(cache) == 0
    assert cache.lookup(NS, PROMPT).match is None


@pytest.mark.parametrize("case", ["closed", "empty", "position_short", "position_long"])
def test_invalid_inserts_release_and_keep_existing_entries(backend, cache, case):
    keep = stored(backend, cache, (1, 2, 3))
    if case == "closed":
        snapshot, tokens = backend.open(PROMPT), PROMPT
        backend.close(snapshot)
    elif case == "empty":
        snapshot, tokens = backend.open(()), ()
    elif case == "position_short":
        snapshot, tokens = backend.open(PROMPT[:9]), PROMPT
    else:
        snapshot, tokens = backend.open(PROMPT + (1,)), PROMPT
    assert not cache.insert(NS, tokens, snapshot).stored
    assert snapshot.closed and snapshot not in backend.live
    assert len(cache) == 1 and not keep.closed
    assert_hit(cache.lookup(NS, (1, 2, 3, 4)).match, (1, 2, 3, 4), 3)


def test_malformed_insert_releases_and_raises(backend, cache):
    snapshot = backend.open((1, 2))
    with pytest.raises(InvalidArgument, match="tokens"):
        cache.insert(NS, (1, -2), snapshot)
    assert snapshot.closed and len(cache) == 0
    other = backend.open((1, 2))
    with pytest.raises(InvalidArgument, match="namespace"):
        cache.insert(7, (1, 2), other)
    assert other.closed
    third = backend.open((1, 2))
    with pytest.raises(InvalidArgument, match="metadata"):
        cache.insert(NS, (1, 2), third, metadata=["priority"])
    assert third.closed and len(cache) == 0
    assert cache.insert(NS, (1, 2), backend.open((1, 2)), {"priority": 3}).stored
    assert cache.entries()[0].metadata == {"priority": "3"}


def test_token_ids_no_session_can_hold_are_never_stored(backend, cache):
    # Keys may hold any id in [0, 2**64) (the index keeps all 64 bits: test_index.py), but the content
    # digest is over int32 ids, as an engine records them: no snapshot matches such a key.
    high = (2**64 - 1, 2**63, 5)
    snapshot = backend.open((7, 8, 5))
    assert cache.insert(NS, high, snapshot).reason == "content_mismatch"
    assert snapshot.closed and len(cache) == 0 and cache.lookup(NS, high + (6,)).match is None


def test_retention_refusal_keeps_entry_and_full_prefix_request_hits(backend, cache):
    snapshot = backend.open(PROMPT, floor=7)  # rows below 7 are gone (sliding window)
    assert cache.insert(NS, PROMPT, snapshot).stored
    assert cache.lookup(NS, PROMPT[:5] + (0, 0)).match is None  # needs a clone at 5 < floor
    assert len(cache) == 1 and cache.stats().refusals["clone_refused"] == 1
    assert_hit(cache.lookup(NS, PROMPT + (0,)).match, PROMPT + (0,), 10)


def test_older_snapshot_serves_a_match_the_newer_one_refuses(backend, cache):
    older = stored(backend, cache, PROMPT[:6] + (1, 1))
    newer = backend.open(PROMPT[:6] + (2, 2), floor=7)
    assert cache.insert(NS, PROMPT[:6] + (2, 2), newer).stored
    request = PROMPT[:6] + (3,)
    assert_hit(cache.lookup(NS, request).match, request, 6)
    assert [source for source, _ in backend.clone_calls] == [newer.id, older.id]


def test_capacity_refusal_neither_leaks_nor_evicts(backend, cache):
    snapshot = stored(backend, cache, PROMPT)
    backend.capacity = len(backend.live)  # no room for a clone
    live_before = set(backend.live)
    assert cache.lookup(NS, PROMPT).match is None
    assert backend.live == live_before and len(cache) == 1 and not snapshot.closed
    backend.capacity = 100
    assert_hit(cache.lookup(NS, PROMPT).match, PROMPT, 9)


def test_clone_allocation_failure_is_a_miss_and_backend_stays_usable(backend, cache):
    stored(backend, cache, PROMPT)
    backend.fail_next = 1
    assert cache.lookup(NS, PROMPT).match is None
    assert cache.stats().refusals["clone_error"] == 1
    assert_hit(cache.lookup(NS, PROMPT).match, PROMPT, 9)


def test_clear_releases_only_owned_snapshots(backend, cache):
    owned = [stored(backend, cache, (i, i + 1)) for i in range(3)]
    handed_out = cache.lookup(NS, (0, 1, 2)).match.session
    bystander = backend.open((9, 9))
    assert cache.clear() == 3
    assert all(s.closed and s.close_calls == 1 for s in owned)
    assert not handed_out.closed and not bystander.closed
    assert len(cache) == 0 and cache.lookup(NS, (0, 1, 2)).match is None


def test_cache_outlives_its_engine_without_clone_calls(backend, cache):
    stored(backend, cache, PROMPT)
    handed_out = cache.lookup(NS, PROMPT).match.session
    calls = len(backend.clone_calls)
    backend.dead = True  # the runner shut down: every handle is invalid
    assert cache.lookup(NS, PROMPT).match is None
    assert len(backend.clone_calls) == calls
    assert not backend.valid(handed_out)
    assert len(cache) == 0  # dead entries are dropped
    cache.clear()


def test_fingerprint_is_part_of_every_key(backend, cache):
    stored(backend, cache, PROMPT)
    backend.fingerprint = "other-model"
    assert cache.lookup(NS, PROMPT).match is None
    backend.fingerprint = "fake-model"
    assert cache.lookup(NS, PROMPT).match is not None
    assert cache.lookup("other-namespace", PROMPT).match is None


def test_eviction_follows_the_policy_and_reports_when_new_entry_is_victim(backend):
    cache = PrefixCache(backend, max_entries=2, policy="priority")
    high = stored(backend, cache, (1, 2), metadata={"priority": 5})
    mid = stored(backend, cache, (3, 4), metadata={"priority": 1})
    low = backend.open((5, 6))
    assert not cache.insert(NS, (5, 6), low, {"priority": 0}).stored  # stored, then evicted at once
    assert low.closed and not high.closed and not mid.closed
    top = backend.open((7, 8))
    assert cache.insert(NS, (7, 8), top, {"priority": 9}).stored
    assert mid.closed and not high.closed


def test_lookup_gives_up_after_max_attempts(backend):
    cache = PrefixCache(backend, max_entries=50, max_attempts=3)
    for i in range(10):
        cache.insert(NS, (1, 2, 100 + i), backend.open((1, 2, 100 + i), floor=3))
    assert cache.lookup(NS, (1, 2, 7)).match is None  # every clone at 2 is below a floor
    assert len(backend.clone_calls) == 3


def test_stats_count_hits_misses_and_reused_tokens(backend, cache):
    stored(backend, cache, PROMPT)
    cache.lookup(NS, PROMPT)
    cache.lookup(NS, PROMPT[:3])
    cache.lookup(NS, (1, 2))
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.reused_tokens, stats.inserts) == (2, 1, 9 + 2, 1)


def test_constructor_validation():
    with pytest.raises(InvalidArgument, match="max_entries"):
        PrefixCache(FakeBackend(), max_entries=-1)
    with pytest.raises(InvalidArgument, match="lru"):
        PrefixCache(FakeBackend(), max_entries=1, policy="nope")
    assert PrefixCache(FakeBackend(), 1, policy=make_policy("lfu")).policy.name == "lfu"
