"""The HTTP door's response store: per-owner and total bounds, the oldest dropped first, the fullest
owner paying for the total, ids of another owner missing, token ids kept exactly."""

from __future__ import annotations

import pytest

from prefix_service.http.response_store import ResponseStore, StoredResponse, packed


def stored(rid: str, prompt=(1, 2, 3), generated=(70000, 5)) -> StoredResponse:
    return StoredResponse(rid, {"id": rid}, (), (), (), packed(prompt), packed(generated), False)


def test_token_ids_and_owners() -> None:
    store = ResponseStore()
    store.put("alice", stored("r1"))
    got = store.get("alice", "r1")
    assert got is not None and got.prompt == (1, 2, 3) and got.generated == (70000, 5)
    assert store.get("bob", "r1") is None and not store.delete("bob", "r1")
    assert store.delete("alice", "r1") and store.get("alice", "r1") is None and len(store) == 0


def test_the_per_owner_cap_drops_that_owners_oldest() -> None:
    store = ResponseStore(per_owner=2, total=10)
    for i in range(3):
        store.put("alice", stored(f"a{i}"))
    store.put("bob", stored("b0"))
    assert store.get("alice", "a0") is None
    assert [store.get("alice", f"a{i}") is not None for i in (1, 2)] == [True, True]
    assert len(store) == 3


def test_the_total_cap_drops_the_fullest_owners_oldest() -> None:
    store = ResponseStore(per_owner=4, total=5)
    for i in range(4):
        store.put("alice", stored(f"a{i}"))
    store.put("bob", stored("b0"))
    store.put("carol", stored("c0"))  # the total is passed: alice (the most) pays, not bob
    assert len(store) == 5 and store.get("alice", "a0") is None
    assert store.get("bob", "b0") is not None and store.get("carol", "c0") is not None
    with pytest.raises(ValueError):
        ResponseStore(per_owner=0)
