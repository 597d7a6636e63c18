"""SuffixIndex: drafts from the same scope's earlier texts, never another scope's; bounded per scope
(oldest texts dropped with their n-grams) and in scopes."""

from __future__ import annotations

from engine_service.executors.suffix_index import SuffixIndex


def test_a_scope_drafts_what_followed_its_latest_occurrence() -> None:
    index = SuffixIndex(n=3)
    index.add("alice", [1, 2, 3, 4, 5, 6, 7])
    index.add("alice", [9, 2, 3, 4, 8, 8])
    assert index.draft("alice", [0, 2, 3, 4], 3) == (8, 8)  # the latest occurrence wins
    assert index.draft("alice", [0, 4, 5, 6], 5) == (7,)
    assert index.draft("alice", [0, 0, 5, 9], 3) == ()  # no occurrence
    assert index.draft("alice", [3, 4], 3) == ()  # too short a context


def test_another_scope_never_drafts_from_it() -> None:
    index = SuffixIndex(n=3)
    index.add("alice", [1, 2, 3, 4, 5, 6, 7])
    assert index.draft("bob", [1, 2, 3], 3) == ()
    assert index.draft("alice", [1, 2, 3], 3) == (4, 5, 6)  # the control


def test_positions_without_a_token_never_draft_or_match() -> None:
    index = SuffixIndex(n=2)
    index.add("a", [5, 6, 7, -1, -1, 8, 9])
    assert index.draft("a", [5, 6], 4) == (7,)  # stops before the prepared positions
    assert index.draft("a", [-1, -1], 2) == ()


def test_each_scope_is_bounded_and_the_oldest_text_leaves_with_its_ngrams() -> None:
    index = SuffixIndex(n=2, max_tokens=10, max_scopes=2)
    index.add("a", [1, 2, 3, 4, 5, 6])
    index.add("a", [7, 8, 9, 10, 11, 12])
    assert index.held_tokens("a") == 6 and index.draft("a", [1, 2], 2) == ()  # the first text left
    assert index.draft("a", [7, 8], 2) == (9, 10)
    index.add("b", [1, 2, 3])
    index.add("c", [1, 2, 3])
    assert index.draft("a", [7, 8], 2) == ()  # the least recently used scope left
    assert index.draft("c", [1, 2], 1) == (3,)
