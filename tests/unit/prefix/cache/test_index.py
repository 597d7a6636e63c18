"""TokenIndex against a brute-force scan, plus the radix-tree invariants that make it fast."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.index import TokenIndex, token_key


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def brute_force(stored: dict[tuple[int, ...], tuple[str, int]], request: tuple[int, ...]):
    """Every stored key sharing >= 1 token, ordered (common desc, rank desc)."""
    found = [(common_prefix(key, request), rank, value) for key, (value, rank) in stored.items()]
    found = [item for item in found if item[0] >= 1]
    found.sort(key=lambda item: (-item[0], -item[1]))
    return [(value, common) for common, _, value in found]


def node_count(index: TokenIndex, namespace) -> int:
    root = index._roots.get(namespace)
    stack, count = ([root] if root else []), 0
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count


# A tiny alphabet forces shared prefixes and edge splits; 2**64 - 1 and 2**63 check the full width.
TOKENS = st.sampled_from([0, 1, 2, 2**63, 2**64 - 1])
KEYS = st.lists(TOKENS, min_size=1, max_size=8).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    inserts=st.lists(KEYS, min_size=0, max_size=25),
    removals=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
    touches=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
    request=st.lists(TOKENS, min_size=0, max_size=10).map(tuple),
)
def test_matches_equal_brute_force_scan(inserts, removals, touches, request):
    index: TokenIndex[str] = TokenIndex()
    stored: dict[tuple[int, ...], tuple[str, int]] = {}
    clock = 0
    for i, key in enumerate(inserts):
        clock += 1
        previous = index.insert("ns", key, f"v{i}", clock)
        assert previous == (stored[key][0] if key in stored else None)
        stored[key] = (f"v{i}", clock)
    keys = list(stored)
    for pick in touches:
        if keys:
            key = keys[pick % len(keys)]
            clock += 1
            assert index.touch("ns", key, clock)
            stored[key] = (stored[key][0], clock)
    for pick in removals:
        if keys:
            key = keys[pick % len(keys)]
            expected = stored.pop(key)[0] if key in stored else None
            assert index.remove("ns", key) == expected
    assert len(index) == len(stored)
    got = [(m.value, m.common) for m in index.matches("ns", request)]
    assert got == brute_force(stored, request)
    for key, (value, _) in stored.items():
        assert index.get("ns", key) == value
    assert sorted(index.values()) == sorted(value for value, _ in stored.values())
    # Compressed edges: every value-less inner node branches, so nodes <= 2 * keys + root.
    assert node_count(index, "ns") <= 2 * len(stored) + 1


def test_64_bit_ids_are_kept_exactly():
    index: TokenIndex[str] = TokenIndex()
    index.insert("ns", (2**64 - 1, 5), "high", 1)
    index.insert("ns", (2**64 - 2, 5), "low", 2)
    assert [(m.value, m.common) for m in index.matches("ns", (2**64 - 1, 5, 7))] == [("high", 2)]
    assert [m.value for m in index.matches("ns", (2**32 - 1, 5))] == []  # truncation would collide
    assert token_key([2**64 - 1]) == (2**64 - 1,)


@pytest.mark.parametrize("bad", [[-1], [2**64], ["a"], [1.5], "abc"])
def test_token_key_rejects_malformed_ids(bad):
    with pytest.raises(InvalidArgument):
        token_key(bad)


def test_namespaces_are_disjoint_and_empty_keys_refused():
    index: TokenIndex[str] = TokenIndex()
    index.insert("a", (1, 2, 3), "in-a", 1)
    assert list(index.matches("b", (1, 2, 3))) == []
    assert [m.value for m in index.matches("a", (1, 2, 3))] == ["in-a"]
    with pytest.raises(ValueError):
        index.insert("a", (), "empty", 2)


def test_removal_restores_compression_and_drops_empty_namespace():
    index: TokenIndex[str] = TokenIndex()
    index.insert("ns", (1, 2, 3, 4), "long", 1)
    index.insert("ns", (1, 2, 9), "branch", 2)  # splits (1,2,3,4) at 2
    assert node_count(index, "ns") == 4  # root, (1,2), (3,4), (9,)
    assert index.remove("ns", (1, 2, 9)) == "branch"
    assert node_count(index, "ns") == 2  # root, (1,2,3,4) merged back
    assert index.remove("ns", (1, 2, 3, 4)) == "long"
    assert index._roots == {}
    assert index.remove("ns", (1, 2, 3, 4)) is None


def test_first_candidates_do_not_expand_the_whole_subtree():
    """A request that stops early shares its prefix with many keys; asking for the best one must
    not visit them all (the rank bounds prune)."""
    index: TokenIndex[int] = TokenIndex()
    for i in range(2000):
        index.insert("ns", (7, 7, i // 50, i), i, i + 1)
    matches = index.matches("ns", (7, 7))
    first = next(matches)
    assert (first.value, first.common) == (1999, 2)
    assert next(matches).value == 1998


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(1, 3), min_size=1, max_size=7).map(tuple)),
        max_size=30,
    )
)
def test_edge_positions_prefixes_and_below_match_a_brute_force_scan(operations):
    """The tree's total edge length is the number of distinct prefixes of the stored keys (what an
    ideal radix tree holds); prefixes / below are the stored keys above / under a key."""
    index: TokenIndex[tuple[int, ...]] = TokenIndex()
    stored: set[tuple[int, ...]] = set()
    for add, key in operations:
        if add:
            index.insert("ns", key, key, 0)
            stored.add(key)
        else:
            index.remove("ns", key)
            stored.discard(key)
        distinct = {key[:n] for key in stored for n in range(1, len(key) + 1)}
        assert index.edge_positions("ns") == index.edge_positions() == len(distinct)
        for probe in stored:
            above = [k for k in stored if len(k) < len(probe) and probe[: len(k)] == k]
            assert index.prefixes("ns", probe) == sorted(above, key=len)
            under = {k for k in stored if len(k) > len(probe) and k[: len(probe)] == probe}
            assert set(index.below("ns", probe)) == under
    index.clear()
    assert index.edge_positions() == 0
