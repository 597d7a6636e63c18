"""Shared prefixes stored once (``prefix_service/cache/sharing.py``): covered entries dropped without
changing any lookup's reuse (against a naive longest-common-prefix reference), branch points at
divergences, and the positions held vs an ideal radix tree's (hand-computed edge lengths).

The fakes: ``FakeBackend`` clones at any position (full attention); ``WindowBackend`` models a
``batched-sequence`` ring (a snapshot of ``n`` positions clones only at ``p >= n - max_write``)."""

from __future__ import annotations

import math
import random

import pytest

from prefix_service.cache.events import EventKind
from prefix_service.cache.prefix_cache import PrefixCache
from tests.unit.prefix.fake_engine import WindowBackend
from tests.unit.prefix.fakes import FakeBackend

NS = "app"
REWIND = 64
SHARED = tuple(range(1000, 1100))  # a 100-token group prompt


def question(tag: int, length: int = 10) -> tuple[int, ...]:
    return tuple(2000 + 100 * tag + i for i in range(length))


def insert(cache: PrefixCache, backend: FakeBackend, tokens, **kwargs) -> bool:
    snapshot = backend.snapshot(tokens) if isinstance(backend, WindowBackend) else backend.open(tokens)
    return cache.insert(NS, tokens, snapshot, **kwargs).stored


def keys(cache: PrefixCache) -> set[tuple[int, ...]]:
    return {entry.tokens for entry in cache.entries()}


def naive_reuse(stored: list[tuple[int, ...]], request: tuple[int, ...], rewind: int | None) -> int:
    """The reuse a cache that keeps every inserted key gives (no index, no dropping)."""
    best = 0
    for key in stored:
        common = 0
        while common < min(len(key), len(request)) and key[common] == request[common]:
            common += 1
        reuse = min(common, len(request) - 1)
        if reuse >= 1 and (rewind is None or len(key) - reuse <= rewind):
            best = max(best, reuse)
    return best


# -- covered entries ----------------------------------------------------------------------------


def test_a_stored_prefix_of_a_new_entry_is_dropped_on_a_flat_engine(backend):
    cache = PrefixCache(backend, 8)
    changes = []
    cache.listen(changes.append)
    short, long = SHARED[:30], SHARED + question(1)
    assert insert(cache, backend, short)
    snapshot = cache.entries()[0].snapshot
    assert insert(cache, backend, long)
    assert keys(cache) == {long}
    assert snapshot.closed  # its snapshot released
    assert [(c.kind, len(c.entry.tokens)) for c in changes][-1] == (EventKind.DROPPED, 30)
    assert cache.stats().covered == 1 and cache.stats().positions == len(long)
    assert cache.lookup(NS, short).reused == 29  # what the dropped entry gave


def test_on_a_ring_a_longer_entry_within_reach_of_position_one_covers_a_shorter():
    backend = WindowBackend(max_write=REWIND, max_rewind=REWIND)
    cache = PrefixCache(backend, 8)
    assert insert(cache, backend, SHARED[:30]) and insert(cache, backend, SHARED[: REWIND + 1])
    assert keys(cache) == {SHARED[: REWIND + 1]}
    assert cache.lookup(NS, SHARED[:5] + (7,)).reused == 5  # 65 - 5 <= 64: still served


def test_on_a_ring_a_shorter_entry_the_longer_cannot_reach_is_kept():
    """Negative control: 100 positions clone only at >= 36, so dropping 30 would lose reuse below 36."""
    backend = WindowBackend(max_write=REWIND, max_rewind=REWIND)
    cache = PrefixCache(backend, 8)
    assert insert(cache, backend, SHARED[:30]) and insert(cache, backend, SHARED)
    assert keys(cache) == {SHARED[:30], SHARED}
    request = SHARED[:20] + (7,)
    assert cache.lookup(NS, request).reused == 20 == naive_reuse([SHARED], request, None)
    assert naive_reuse([SHARED], request, REWIND) == 0  # what the longer one alone would give


@pytest.mark.parametrize("rewind", [None, 12])
@pytest.mark.parametrize("seed", range(6))
def test_dropping_covered_entries_never_changes_a_lookups_reuse(rewind, seed):
    """Random prompts over a small alphabet (many prefixes of each other); after each insert every
    probe's reuse equals the naive reference over every key inserted so far."""
    rng = random.Random(seed)
    backend = WindowBackend(max_write=rewind, max_rewind=rewind) if rewind else FakeBackend()
    cache = PrefixCache(backend, 10_000, branch_min=0)
    inserted: list[tuple[int, ...]] = []
    for _ in range(40):
        base = rng.choice(inserted) if inserted and rng.random() < 0.7 else ()
        cut = rng.randint(0, len(base))
        prompt = base[:cut] + tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 8)))
        prompt = prompt[:30] or (1,)
        insert(cache, backend, prompt)
        inserted.append(prompt)
        for _ in range(12):
            source = rng.choice(inserted)
            probe = source[: rng.randint(1, len(source))] + tuple(
                rng.randint(1, 3) for _ in range(rng.randint(0, 3))
            )
            outcome = cache.lookup(NS, probe)
            assert outcome.reused == naive_reuse(inserted, probe, rewind), probe
            if outcome.match is not None:
                assert outcome.session.tokens == probe[: outcome.reused]
                backend.close(outcome.session)
    assert cache.stats().covered > 0  # the property was tested with drops happening
    assert len(cache) + cache.stats().covered == cache.stats().inserts


# -- branch points ------------------------------------------------------------------------------


def test_a_divergence_keeps_a_branch_point_a_third_prompt_reuses_and_that_outlives_the_leaves(backend):
    cache = PrefixCache(backend, 8, branch_min=64)
    a, b = SHARED + question(1), SHARED + question(2)
    assert insert(cache, backend, a) and insert(cache, backend, b)
    branch = next(e for e in cache.entries() if e.metadata.get("boundary") == "branch")
    assert branch.tokens == SHARED and branch.snapshot.tokens == SHARED  # what the engine holds
    assert cache.stats().branches == 1 and len(cache) == 3
    third = SHARED + question(3)
    outcome = cache.lookup(NS, third)
    assert outcome.reused == len(SHARED)
    assert backend.clone_calls[-1] == (branch.snapshot.id, len(SHARED))  # cloned from the branch point
    assert insert(cache, backend, third) and cache.stats().branches == 1  # none again at the same place
    assert cache.evict(3) == 3  # the three leaves go first, although the branch point is older
    assert keys(cache) == {SHARED}
    assert cache.lookup(NS, SHARED + question(4)).reused == len(SHARED)


def test_no_branch_point_below_the_minimum_or_when_off(backend):
    cache = PrefixCache(backend, 8, branch_min=101)
    insert(cache, backend, SHARED + question(1))
    insert(cache, backend, SHARED + question(2))
    off = PrefixCache(backend, 8, branch_min=0)
    insert(off, backend, SHARED + question(1))
    insert(off, backend, SHARED + question(2))
    assert cache.stats().branches == off.stats().branches == 0 and len(cache) == len(off) == 2


@pytest.mark.parametrize(("second_tail", "made"), [(10, True), (80, False)])
def test_on_a_ring_a_branch_point_is_cloned_only_from_a_snapshot_within_reach(second_tail, made):
    backend = WindowBackend(max_write=REWIND, max_rewind=REWIND)
    cache = PrefixCache(backend, 8)
    insert(cache, backend, SHARED + question(1, 100))  # 200 positions: 100 is beyond its reach
    insert(cache, backend, SHARED + question(2, second_tail))
    assert (SHARED in keys(cache)) is made and cache.stats().branches == int(made)


# -- positions held vs an ideal radix tree -------------------------------------------------------

RADIX_KEYS = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 7, 8), (1, 2, 9), (5, 5)]
# the tree: [1 2] -> [3] -> [4 5 6] | [7 8]; [1 2] -> [9]; [5 5]: 2 + 1 + 3 + 2 + 1 + 2 = 11 edges


@pytest.mark.parametrize("shares", [False, True])
def test_positions_held_and_the_ideal_radix_trees(shares):
    backend = FakeBackend()
    backend.clone_shared_share = float(shares)  # batched-cell or flat layers: clones share the rows
    cache = PrefixCache(backend, 16, branch_min=0)
    for key in RADIX_KEYS:
        insert(cache, backend, key)
    assert cache.insert("other", (1, 2, 3), backend.open((1, 2, 3))).stored
    stats = cache.stats()
    assert stats.radix_positions == 11 + 3
    assert stats.positions == (14 if shares else 6 + 5 + 3 + 2 + 3)
    mine = cache.stats(lambda ns: ns == NS)
    assert (mine.radix_positions, mine.positions) == (11, 11 if shares else 16)
    victim = next(e for e in cache.entries(NS) if e.tokens == (1, 2, 9))
    cache._drop(victim, EventKind.EVICTED)
    assert cache.stats().radix_positions == 13  # a leaf frees only its own edge
    assert cache.stats().positions == (13 if shares else 16)
    victim = next(e for e in cache.entries(NS) if e.tokens == (1, 2, 3, 4, 5, 6))
    cache._drop(victim, EventKind.EVICTED)
    assert cache.stats().radix_positions == 10  # [1 2 3] and [7 8] merge: 8 + 2


@pytest.mark.parametrize(("share", "held"), [(0.5, 14), (0.25, 15), ("yes", 16), (True, 16)])
def test_a_partial_share_counts_that_share_once(share, held):
    """A model with ring layers: clones share only the flat layers' bytes (11 radix, 16 key positions:
    half of each); a share that is not a number counts as a whole copy (the control)."""
    backend = FakeBackend()
    backend.clone_shared_share = share
    cache = PrefixCache(backend, 16, branch_min=0)
    for key in RADIX_KEYS:
        insert(cache, backend, key)
    assert cache.stats().positions == held


@pytest.mark.parametrize(("limit", "held"), [(0, 14), (5, 13), (6, 11), (3, 14)])
def test_entries_under_the_ring_limit_share_every_layer(limit, held):
    """Half of a position's bytes shared always (flat layers); below the engine's ring limit the rest
    too: the short entries' part counted once per tree position, the longer entries' a copy each. Keys
    (1 2 3 4 5 6) 6, (1 2 3 7 8) 5, (1 2 9) 3, (5 5) 2: limit 5 -> the short tree [1 2] [3 7 8] [9] [5 5]
    holds 8 and the long key 6 is copied: (11 + 14) / 2 -> 13; limit 6: all short, 11; limit 3: the short
    keys share nothing, (11 + 5 + 11) / 2 -> 14, as limit 0 (every key copied)."""
    backend = FakeBackend()
    backend.clone_shared_share, backend.clone_shared_ring_positions = 0.5, limit
    cache = PrefixCache(backend, 16, branch_min=0)
    for key in RADIX_KEYS:
        insert(cache, backend, key)
    copied = {0: 16, 5: 8 + 6, 6: 11, 3: 5 + 11}[limit]
    assert cache.stats().positions == held == math.ceil((11 + copied) / 2 - 1e-9)
    assert cache.stats(lambda ns: ns == NS).positions == held  # every entry is in NS
    backend.clone_shared_ring_positions = 0  # the engine says another limit: regrouped
    assert cache.stats().positions == 14


@pytest.mark.parametrize(("shares", "kept"), [(True, 4), (False, 3)])
def test_the_positions_bound_counts_shared_prefixes_once_where_clones_share(shares, kept):
    backend = FakeBackend()
    backend.clone_shared_share = float(shares)
    cache = PrefixCache(backend, 16, max_positions=14, branch_min=0)
    for key in RADIX_KEYS:
        insert(cache, backend, key)
    assert len(cache) == kept  # 11 tree positions fit 14; 16 key positions do not: the oldest goes


# -- branch points for checkpoints ---------------------------------------------------------------


def test_branch_points_are_where_stored_prompts_part_on_a_prompts_path(backend):
    cache = PrefixCache(backend, 8, branch_min=0)
    insert(cache, backend, SHARED + question(1))
    assert cache.branch_points(NS, SHARED + question(1)) == ()  # nothing parts from it
    assert cache.branch_points(NS, SHARED[:40] + question(2)) == (40,)  # where it leaves the stored one
    insert(cache, backend, SHARED + question(2))
    assert cache.branch_points(NS, SHARED + question(1)) == (100,)
    assert cache.branch_points(NS, SHARED[:40] + question(3)) == (40,)
    assert cache.branch_points(NS, SHARED[:40]) == ()  # a prefix of the stored ones: no divergence


@pytest.mark.parametrize(("branch_min", "reused"), [(64, [100, 100, 100]), (0, [0, 100, 100])])
def test_under_a_positions_bound_the_leaves_under_branch_points_go_first(branch_min, reused):
    """batched-sequence (a copy per entry), room for 420 positions: with branch points the three
    group prefixes (300) stay and the leaves copying them go first; without, the three latest
    prompts (110 each) stay and the first group's is lost (the negative control)."""
    backend = FakeBackend()
    cache = PrefixCache(backend, 16, max_positions=420, branch_min=branch_min)
    groups = [tuple(range(10_000 * g, 10_000 * g + 100)) for g in (1, 2, 3)]
    for group in groups:
        for tag in (1, 2):
            insert(cache, backend, group + question(tag))
    assert cache.stats().positions <= 420
    assert [cache.lookup(NS, group + question(3)).reused for group in groups] == reused
    leaves = [e for e in cache.entries() if not e.is_branch]
    assert all(e.shadowed == (100 if branch_min else 0) for e in leaves)


def test_where_clones_share_cells_a_branch_point_costs_an_entry_and_no_positions():
    backend = FakeBackend()
    backend.clone_shared_share = 1.0
    cache = PrefixCache(backend, 16)
    insert(cache, backend, SHARED + question(1))
    insert(cache, backend, SHARED + question(2))
    assert cache.stats().branches == 1 and len(cache) == 3
    assert cache.stats().positions == cache.stats().radix_positions == 100 + 10 + 10
    assert {e.shadowed for e in cache.entries() if not e.is_branch} == {100}  # the leaves go first


def test_a_dropped_branch_point_no_longer_shadows_its_leaves(backend):
    cache = PrefixCache(backend, 16)
    insert(cache, backend, SHARED + question(1))
    insert(cache, backend, SHARED + question(2))
    branch = next(e for e in cache.entries() if e.is_branch)
    assert {e.shadowed for e in cache.entries() if e is not branch} == {100}
    cache.clear(lambda ns: False)  # a no-op control: nothing cleared, nothing re-shaded
    cache._drop(branch, EventKind.EVICTED)
    assert {e.shadowed for e in cache.entries()} == {0}


# -- a key a stored longer entry covers is not stored again --------------------------------------


def test_a_prompt_a_stored_answer_extends_is_refused_and_the_answer_refreshed(backend):
    cache = PrefixCache(backend, 8)
    answer = SHARED + question(1)  # e.g. a prompt and its generated answer
    assert insert(cache, backend, answer)
    other = insert(cache, backend, question(2))
    assert other
    assert cache.reserve(NS, SHARED) == "duplicate"  # nothing to capture: the answer serves it
    assert not insert(cache, backend, SHARED)
    assert keys(cache) == {answer, question(2)}
    assert cache.lookup(NS, SHARED + (5,)).match.reused == len(SHARED)  # served from the answer
    victim = min(cache.entries(), key=cache.policy.priority)
    assert victim.tokens == question(2)  # the refusal refreshed the answer


def test_a_ring_entry_too_far_past_a_prefix_does_not_cover_it():
    backend = WindowBackend(max_write=REWIND, max_rewind=REWIND)
    cache = PrefixCache(backend, 8, branch_min=0)
    assert insert(cache, backend, SHARED + question(1, 20))  # its floor lies past position 1 of SHARED
    assert insert(cache, backend, SHARED)  # so the prompt's own snapshot is kept (the control)
    near = PrefixCache(backend, 8, branch_min=0)
    assert insert(near, backend, SHARED[:30] + question(1, 20))  # 50 positions: every reuse in reach
    assert not insert(near, backend, SHARED[:30])  # covered
