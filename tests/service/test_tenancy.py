"""Tenants that cannot see each other (issue 21 items 1-2), over a real engine and a real prefix
service with bearer tokens (owners alice, bob, the admin ops) on port 0.

- A namespace belongs to its owner: bob's Lookup / Generate in alice's namespace, with her exact prompt
  or the PIN-guessing variants, answers exactly what a namespace nobody used answers (no reuse, the
  same reason and fields); control: alice still hits her own, and her own variants show the oracle
  that bob no longer has. A shared namespace (``--shared_namespace``) still shares; ``cache_salt``
  partitions. Snapshot files keep the scoping: after a restart a restored entry is its owner's again.
- Clear and Stats are the caller's: bob's Clear leaves alice's entries (her next round reuses), bob's
  Stats counts only his; the admin owner sees and clears everything.
- Without tokens owners are self-declared and namespaces are shared as before (loopback only).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from clients.prefix_client import LookupResult, PrefixClient
from engine_service.api.config import GenConfig
from engine_service.serving.auth import ServerSecurity
from engine_service.serving.tokens import TokenTable
from prefix_service.engines.connect import connect_engine
from prefix_service.gateway.tenancy import Tenancy
from prefix_service.rpc.server import create_server
from prefix_service.tier.persistent_tier import PersistentTier

TOKENS = {
    "alice-0123456789abcdefghij": "alice",
    "bob-0123456789abcdefghijkl": "bob",
    "ops-0123456789abcdefghijkl": "ops",
}
ALICE, BOB, OPS = list(TOKENS)
SECRET = "System: you are a bank assistant. My bank PIN is {pin}, please keep it safe for me."
PIN = "4817"
SHARED = "system"


def pin_prompt(pin: str = PIN) -> str:
    return SECRET.format(pin=pin)


@dataclass
class Service:
    server: object
    port: int

    tokens: TokenTable | None = None

    def client(self, token: str | None = None, owner: str = "anonymous") -> PrefixClient:
        return PrefixClient(f"127.0.0.1:{self.port}", token=token, owner=owner)


@pytest.fixture
def services(engine_factory, tmp_path) -> Iterator:
    """``services(auth=True, folder=None)``: a prefix service over a fresh engine (tokens alice, bob,
    ops; ops is --admin_owner; ``system`` is shared); all stopped at teardown."""
    started: list = []
    tiers: list = []
    table_file = tmp_path / "tokens"
    table_file.write_text("".join(f"{t} {o}\n" for t, o in TOKENS.items()), encoding="utf-8")
    table_file.chmod(0o600)
    engine = engine_factory(max_sessions=16)

    def make(auth: bool = True, folder=None) -> Service:
        tier = PersistentTier.open(str(folder), 1 << 30) if folder is not None else None
        tokens = TokenTable.load(str(table_file)) if auth else None
        gateway, channel = connect_engine(engine.address, max_entries=16, ready_timeout=10, tier=tier)
        server, port = create_server(
            gateway,
            "127.0.0.1:0",
            channel=channel,
            security=ServerSecurity(tokens=tokens) if tokens is not None else None,
            tenancy=Tenancy.of([SHARED], admin="ops"),
        )
        started.append(server)
        tiers.append(tier)
        return Service(server, port, tokens)

    yield make
    for server in reversed(started):
        server.stop(0, release=False)
    for tier in tiers:
        if tier is not None:
            tier.stop()


def generate(client: PrefixClient, text: str, namespace: str, **kw) -> int:
    """A gateway Generate of ``text`` in ``namespace``; the positions its lookup reused."""
    return (
        client.generate(text=text, namespace=namespace, config=GenConfig(max_new_tokens=1), **kw)
        .collect()
        .done.reused_positions
    )


def answer(found: LookupResult) -> tuple:
    """Everything a Lookup tells its caller, but the session handle (unguessable, different per call)."""
    return (
        found.session is not None,
        found.reused,
        found.reason,
        found.diverged_at,
        found.tokens,
        found.engine,
    )


def test_a_foreign_namespace_answers_exactly_as_a_missing_one(services) -> None:
    svc = services()
    alice, bob = svc.client(ALICE), svc.client(BOB)
    assert generate(alice, pin_prompt(), "tenant-alice") == 0
    own = len(alice.lookup(text=pin_prompt()).tokens) - 1
    assert generate(alice, pin_prompt(), "tenant-alice") == own  # control: alice hits her own
    assert alice.lookup(text=pin_prompt(), namespace="tenant-alice").reused == own
    # control: for alice herself a guess leaks how far it matches (the oracle bob had)
    guess = alice.lookup(text=pin_prompt("4818"), namespace="tenant-alice").reused
    wrong = alice.lookup(text=pin_prompt("1111"), namespace="tenant-alice").reused
    assert own > guess > wrong > 0
    for pin in (PIN, "4818", "1111"):
        foreign = bob.lookup(text=pin_prompt(pin), namespace="tenant-alice")
        missing = bob.lookup(text=pin_prompt(pin), namespace="nobody-used-this")
        assert answer(foreign) == answer(missing), pin
        assert (foreign.session, foreign.reused, foreign.reason) == (None, 0, "empty")
    # bob's gateway Generate in alice's namespace reuses nothing and stores under his own scope
    assert generate(bob, pin_prompt("4818"), "tenant-alice") == 0
    assert generate(bob, pin_prompt("4818"), "tenant-alice") == own  # his own entry now
    assert alice.lookup(text=pin_prompt("4818"), namespace="tenant-alice").reused == guess  # not bob's
    assert bob.lookup(text=pin_prompt(), namespace="tenant-alice").reused < own  # his, not hers


def test_a_shared_namespace_shares_and_cache_salt_partitions(services) -> None:
    svc = services()
    alice, bob = svc.client(ALICE), svc.client(BOB)
    prompt = "System: a long common system prompt every tenant uses, kept once for all of them."
    assert generate(alice, prompt, SHARED) == 0
    full = len(bob.lookup(text=prompt, namespace=SHARED).tokens) - 1
    assert bob.lookup(text=prompt, namespace=SHARED).reused == full  # alice's entry, shared
    assert generate(bob, prompt, SHARED) == full
    # cache_salt partitions a namespace: another salt, or none, is another partition
    assert generate(alice, prompt, "mine", cache_salt="s1") == 0
    assert alice.lookup(text=prompt, namespace="mine", cache_salt="s1").reused == full
    assert alice.lookup(text=prompt, namespace="mine", cache_salt="s2").reason == "empty"
    assert alice.lookup(text=prompt, namespace="mine").reason == "empty"
    assert bob.lookup(text=prompt, namespace="mine", cache_salt="s1").reason == "empty"  # alice's
    assert bob.lookup(text=prompt, namespace=SHARED, cache_salt="x").reason == "empty"


def test_clear_and_stats_are_the_callers_the_admin_sees_all(services) -> None:
    svc = services()
    alice, bob, ops = svc.client(ALICE), svc.client(BOB), svc.client(OPS)
    generate(alice, pin_prompt(), "tenant-alice")
    generate(alice, "Alice's second prompt, a different one entirely.", "other")
    generate(bob, "Bob's only prompt, which he may clear.", "tenant-bob")
    full = len(alice.lookup(text=pin_prompt(), namespace="tenant-alice").tokens) - 1
    assert (alice.stats().entries, bob.stats().entries, ops.stats().entries) == (2, 1, 3)
    mine = bob.stats()
    assert mine.hits == 0 and mine.misses == 0 and mine.pressure_evictions == 0  # nothing of others'
    assert alice.stats().hits == 1 and alice.stats().reused_positions == full  # her lookup above
    assert bob.clear() == 1  # only his own
    assert generate(alice, pin_prompt(), "tenant-alice") == full  # her entries untouched
    assert (alice.stats().entries, bob.stats().entries, ops.stats().entries) == (2, 0, 2)
    generate(bob, "Bob again.", "tenant-bob")
    generate(alice, "A shared prompt.", SHARED)
    assert (bob.stats().entries, ops.stats().entries) == (1, 4)  # shared entries: the admin's view
    assert bob.clear() == 1 and alice.clear() == 2  # neither clears the shared namespace
    assert ops.stats().entries == 1
    assert ops.clear() == 1 and ops.stats().entries == 0


def test_without_tokens_namespaces_are_shared_as_before(services) -> None:
    svc = services(auth=False)
    alice, bob = svc.client(owner="alice"), svc.client(owner="bob")  # self-declared
    assert generate(alice, pin_prompt(), "tenant-alice") == 0
    full = len(alice.lookup(text=pin_prompt()).tokens) - 1
    assert bob.lookup(text=pin_prompt(), namespace="tenant-alice").reused == full
    assert bob.stats().entries == 1 and bob.clear() == 1  # every caller is the operator


def test_snapshot_files_keep_the_owner(services, tmp_path) -> None:
    folder = tmp_path / "snapshots"
    first = services(folder=folder)
    assert generate(first.client(ALICE), pin_prompt(), "tenant-alice") == 0
    assert first.server.gateway.tier.writer.flush(10)
    first.server.stop(0, release=True)
    second = services(folder=folder)  # a restarted service: memory empty, the folder not
    alice, bob = second.client(ALICE), second.client(BOB)
    found = bob.lookup(text=pin_prompt(), namespace="tenant-alice")
    assert (found.session, found.reason) == (None, "empty")
    full = len(found.tokens) - 1
    assert alice.lookup(text=pin_prompt(), namespace="tenant-alice").reused == full  # restored, hers
    assert bob.stats().entries == 0 and alice.stats().entries == 1


def cached_tokens(base: str, token: str, content: str, **extra) -> int:
    """One chat through the HTTP door as ``token``'s owner: the prompt positions it reused."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1, **extra}
    response = httpx.post(
        f"{base}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {token}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("shared", [False, True])
def test_the_http_door_uses_the_callers_namespace_unless_one_is_shared(services, shared) -> None:
    svc = services()
    namespace = SHARED if shared else ""
    port = svc.server.start_http("127.0.0.1", 0, model_name="tiny", auth=svc.tokens, namespace=namespace)
    base = f"http://127.0.0.1:{port}"
    assert cached_tokens(base, ALICE, pin_prompt()) == 0
    full = cached_tokens(base, ALICE, pin_prompt())
    assert full > 40  # alice's repeat reuses her prompt
    assert cached_tokens(base, BOB, pin_prompt()) == (full if shared else 0)
    assert cached_tokens(base, ALICE, pin_prompt(), cache_salt="s1") == 0  # a partition of its own
    assert cached_tokens(base, ALICE, pin_prompt(), cache_salt="s1") == full
    assert cached_tokens(base, BOB, pin_prompt(), cache_salt="s1") == (full if shared else 0)
