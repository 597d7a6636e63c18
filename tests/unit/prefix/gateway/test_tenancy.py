"""Tenancy scopes (``prefix_service/gateway/tenancy.py``) and the cache's scoped clear / stats."""

from __future__ import annotations

import itertools

import pytest

from engine_service.api.errors import InvalidArgument
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway.tenancy import Tenancy, Tenant, owner_of_scope
from tests.unit.prefix.fakes import FakeBackend

TENANCY = Tenancy.of(["system"], admin="ops")
ALICE, BOB, OPS = Tenant("alice", True), Tenant("bob", True), Tenant("ops", True)


def test_scopes_are_injective_over_owners_namespaces_and_salts() -> None:
    owners = [ALICE, BOB, Tenant("alice"), Tenant("bob")]
    namespaces = ["", "n", "system", '["alice", "n", ""]', '["alice","n",""]', "[", "n\x00"]
    salts = ["", "s", '"', "n"]
    seen: dict[str, tuple] = {}
    for tenant, namespace, salt in itertools.product(owners, namespaces, salts):
        scope = TENANCY.scope(tenant, namespace, salt)
        bound = tenant.authenticated and namespace != "system"
        identity = (tenant.owner if bound else "", namespace, salt)
        assert seen.setdefault(scope, identity) == identity, (scope, identity)
        assert owner_of_scope(scope) == identity[0]


def test_bound_shared_and_unauthenticated_scopes() -> None:
    assert TENANCY.scope(ALICE, "n") != TENANCY.scope(BOB, "n")  # each owner's own
    assert TENANCY.scope(ALICE, "system") == TENANCY.scope(BOB, "system") == "system"  # shared
    assert TENANCY.scope(Tenant("alice"), "n") == TENANCY.scope(Tenant("bob"), "n") == "n"  # as before
    assert TENANCY.scope(ALICE, "system", "x") != TENANCY.scope(ALICE, "system")  # salt partitions
    assert TENANCY.scope(Tenant("a"), "n", "x") != "n"


def test_visibility_admin_and_refusals() -> None:
    assert TENANCY.visible(OPS) is None and TENANCY.visible(Tenant("bob")) is None  # admin, no auth
    mine = TENANCY.visible(ALICE)
    assert mine(TENANCY.scope(ALICE, "n")) and mine(TENANCY.scope(ALICE, "n", "s"))
    assert not mine(TENANCY.scope(BOB, "n")) and not mine("system") and not mine("n")
    assert Tenancy().visible(OPS) is not None  # no admin named: nobody is one
    with pytest.raises(InvalidArgument, match="admin_owner"):
        Tenancy.of(admin="x" * 1000)
    with pytest.raises(InvalidArgument, match="namespace must be a string"):
        TENANCY.scope(ALICE, 3)  # type: ignore[arg-type]


def test_the_cache_clears_and_counts_only_the_chosen_namespaces() -> None:
    backend = FakeBackend()
    cache = PrefixCache(backend, max_entries=8)
    a, b = TENANCY.scope(ALICE, "n"), TENANCY.scope(BOB, "n")
    for namespace, tokens in ((a, (5, 6, 7)), (a, (8, 9)), (b, (5, 6, 7, 8))):
        assert cache.insert(namespace, tokens, backend.open(tokens)).stored
    assert cache.lookup(a, (5, 6, 7, 1)).match is not None
    assert cache.lookup(b, (8, 9)).match is None  # alice's tokens in bob's scope: a miss
    theirs = TENANCY.visible(ALICE)
    mine = cache.stats(theirs)
    assert (mine.entries, mine.positions, mine.hits, mine.reused_tokens, mine.misses) == (2, 5, 1, 3, 0)
    assert cache.stats().entries == 3 and cache.stats().misses == 1
    assert cache.clear(TENANCY.visible(BOB)) == 1
    assert [e.namespace[1] for e in cache.entries()] == [a, a]
    assert cache.lookup(a, (8, 9, 1)).match is not None  # alice's still there
    assert cache.clear() == 2 and len(cache) == 0


def test_a_foreign_lookup_does_the_work_of_a_missing_one() -> None:
    """What a timing attacker could read: the backend calls (no clone, no digest) and the outcome of
    bob's lookup of alice's prompt in her namespace are those of a namespace nobody used."""
    backend = FakeBackend()
    cache = PrefixCache(backend, max_entries=8)
    prompt = tuple(range(10, 40))
    alice = TENANCY.scope(ALICE, "tenant-alice")
    assert cache.insert(alice, prompt, backend.open(prompt)).stored
    outcomes, calls = [], []
    for scope in (TENANCY.scope(BOB, "tenant-alice"), TENANCY.scope(BOB, "never-used")):
        before = (len(backend.clone_calls), backend.digest_calls)
        outcomes.append(cache.lookup(scope, prompt + (1,)))
        calls.append((len(backend.clone_calls) - before[0], backend.digest_calls - before[1]))
        assert cache.reusable(scope, prompt + (1,)) == 0
    assert outcomes[0] == outcomes[1] and outcomes[0].match is None and calls == [(0, 0), (0, 0)]
    assert cache.lookup(alice, prompt + (1,)).match is not None  # control: alice's own hits
    assert backend.clone_calls  # ... with a clone


def test_the_flags_declare_the_tenancy() -> None:
    from prefix_service.__main__ import parse_args, tenancy

    args = parse_args(
        ["--engine", "x:1", "--shared_namespace", "a", "--shared_namespace", "b", "--admin_owner", "ops"]
    )
    assert tenancy(args) == Tenancy.of(["a", "b"], admin="ops")
    args = parse_args(["--engine", "x:1", "--http_namespace", "web"])
    assert (tenancy(args), args.http_namespace) == (Tenancy.of(["web"]), "web")  # shared, as declared
    assert tenancy(parse_args(["--engine", "x:1"])) == Tenancy()  # nothing shared, no admin
