"""Retention policies: sort keys, the registry, and eviction through the cache."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import (
    Entry,
    LRUPolicy,
    RetentionPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from tests.unit.prefix.fakes import FakeBackend


def entry(name: str, last_used: int, hits: int = 0, **metadata: str) -> Entry:
    return Entry(
        "ns", (1,), name, created=0, last_used=last_used, hits=hits, metadata=MappingProxyType(metadata)
    )


def eviction_order(policy: RetentionPolicy, entries: list[Entry]) -> list[str]:
    return [e.snapshot for e in sorted(entries, key=policy.priority)]


def test_unknown_policy_lists_valid_names():
    with pytest.raises(InvalidArgument) as info:
        make_policy("fifo-ish")
    for name in ("lfu", "lru", "priority"):
        assert name in str(info.value)
    with pytest.raises(InvalidArgument):
        make_policy(None)


def test_lru_orders_by_last_use_whatever_the_boundary_once_a_checkpoint_was_used():
    entries = [
        entry("new-checkpoint", 9, hits=1, boundary="breakpoint"),
        entry("old-prompt", 1),
        entry("mid", 5),
    ]
    assert eviction_order(make_policy("lru"), entries) == ["old-prompt", "mid", "new-checkpoint"]


def test_lru_evicts_a_checkpoint_no_lookup_used_before_any_prompt():
    entries = [entry("new-checkpoint", 9, boundary="breakpoint"), entry("old-prompt", 1), entry("mid", 5)]
    assert eviction_order(make_policy("lru"), entries) == ["new-checkpoint", "old-prompt", "mid"]


def test_priority_policy_reads_priority_then_boundary_then_recency():
    entries = [
        entry("p1-old", 1, priority="1"),
        entry("p0-checkpoint", 2, boundary="breakpoint"),
        entry("p0-prompt-new", 8),
        entry("p0-prompt-old", 3, boundary="prompt"),
        entry("garbage-priority", 4, priority="not-a-number"),  # counts as 0
        entry("negative", 9, priority="-2"),
    ]
    assert eviction_order(make_policy("priority"), entries) == [
        "negative",
        "p0-prompt-old",
        "garbage-priority",
        "p0-prompt-new",
        "p0-checkpoint",
        "p1-old",
    ]


def test_lfu_orders_by_hits_then_recency():
    entries = [entry("hot", 1, hits=5), entry("cold-new", 9), entry("cold-old", 2)]
    assert eviction_order(make_policy("lfu"), entries) == ["cold-old", "cold-new", "hot"]


def test_registered_policy_is_selectable_by_name():
    class LongestFirst(RetentionPolicy):
        name = "short-keys-first-test"

        def priority(self, entry: Entry):
            return (entry.key_length,)

    register_policy(LongestFirst.name, LongestFirst)
    assert LongestFirst.name in policy_names()
    backend = FakeBackend()
    cache = PrefixCache(backend, max_entries=2, policy=LongestFirst.name)
    keep = backend.open((1, 2, 3))
    short = backend.open((4, 5))
    cache.insert("ns", (1, 2, 3), keep)
    cache.insert("ns", (4, 5), short)
    cache.insert("ns", (6, 7, 8, 9), backend.open((6, 7, 8, 9)))
    assert short.closed and not keep.closed
    assert isinstance(make_policy(LRUPolicy()), LRUPolicy)


def test_default_lru_does_not_protect_early_snapshots():
    backend = FakeBackend()
    cache = PrefixCache(backend, max_entries=3)
    early = backend.open((1, 2))
    cache.insert("ns", (1, 2), early, {"boundary": "breakpoint"})
    for i in range(3):
        cache.insert("ns", (5, i), backend.open((5, i)))
    assert early.closed and len(cache) == 3


def test_lru_never_evicts_a_prompt_reused_more_than_a_stored_checkpoint_for_it():
    used_prompt = entry("old-prompt-3-hits", 1, hits=3)
    checkpoint = entry("checkpoint-1-hit", 5, hits=1, boundary="breakpoint")
    lru = make_policy("lru")
    assert lru.victim([used_prompt, checkpoint, entry("new", 9)]).snapshot == "checkpoint-1-hit"
    # negative control: a prompt reused no more than the checkpoint goes by recency
    same = entry("old-prompt-1-hit", 1, hits=1)
    assert lru.victim([same, checkpoint, entry("new", 9)]).snapshot == "old-prompt-1-hit"


def test_a_branch_point_outlives_the_leaves_below_it_under_every_policy():
    backend = FakeBackend()
    for name in ("lru", "lfu", "priority"):
        cache = PrefixCache(backend, 8, policy=name, branch_min=4)
        for tail in ((7, 7), (8, 8)):
            assert cache.insert("ns", (1, 2, 3, 4) + tail, backend.open((1, 2, 3, 4) + tail)).stored
        cache.lookup("ns", (1, 2, 3, 4, 8, 8, 9))  # a hit below it counts for it too
        assert cache.evict(2) == 2
        assert [e.tokens for e in cache.entries()] == [(1, 2, 3, 4)], name
