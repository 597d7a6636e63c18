"""Prefix service over real sockets: Lookup, Insert, Stats and Clear, miss reasons, refused ids."""

from __future__ import annotations

import pytest

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api import errors
from engine_service.api.config import GenConfig
from tests.service.helpers import PROMPT, gateway_round, in_process_tokens, sampled, wait_for


def test_lookup_insert_stats_clear(engine, prefix_factory) -> None:
    prefix = prefix_factory(engine.address)
    alice_engine = EngineClient(engine.address, owner="alice")
    alice = PrefixClient(prefix.address, owner="alice")
    run = alice_engine.generate(PROMPT, config=GenConfig(max_new_tokens=3), prompt_snapshot=True).collect()
    snap = run.snapshots[0].handle
    assert not alice.insert(PROMPT[:-1], snap)  # position != len(tokens): refused
    assert alice.insert(PROMPT, snap, metadata={"priority": "2"})
    assert alice_engine.describe(snap) == (len(PROMPT), False)  # the caller keeps its own session
    hit = alice.lookup(PROMPT[:50] + [1, 2, 3])
    assert (hit.reused, hit.reason, list(hit.tokens)) == (50, "unspecified", PROMPT[:50] + [1, 2, 3])
    assert hit.diverged_at == 50
    # the clone belongs to the caller: it continues a generation equal to a cold run
    warm = alice_engine.generate([1, 2, 3], session=hit.session, **sampled(6)).collect()
    assert warm.tokens == in_process_tokens(PROMPT[:50] + [1, 2, 3], 6, temperature=10.0, seed=7)
    with pytest.raises(errors.NotFound):  # ...and to nobody else
        EngineClient(engine.address, owner="bob").describe(hit.session)
    # PROMPT was stored as ids without BOS: the text must be tokenized without it to match
    text = "The quick brown fox jumps over the lazy dog. The"
    text_hit = alice.lookup(text=text, add_special_tokens=False)
    assert text_hit.reused == len(text) - 1
    assert alice.lookup(text=text).reused == 0  # by default plain text gets BOS (position 0 differs)
    assert alice.lookup([9, 9, 9]).reason == "diverged"
    assert alice.lookup(PROMPT, namespace="other").reason == "empty"
    assert alice.lookup([PROMPT[0]]).reason == "too_short"
    stats = alice.stats()
    assert (stats.entries, stats.hits, stats.inserts, stats.policy) == (
        1,
        2,
        1,
        "lru",
    ) and stats.engine_instance_id
    assert alice.clear() == 1
    assert alice.lookup(PROMPT).reason == "empty"
    alice_engine.release_owner()
    assert wait_for(lambda: engine.runner.resident_sessions == 0)


def test_window_refused_by_retention(engine, prefix_factory) -> None:
    """Ring layers keep only the last window + 63 positions of a 90-token snapshot: a request that
    diverges at 20 matches the entry, but the rows are gone there (a ``window`` miss; no checkpoint:
    the prompt is shorter than the checkpoint stride)."""
    prefix = prefix_factory(engine.address)
    gateway_round(prefix, max_new_tokens=1)
    alice = PrefixClient(prefix.address, owner="alice")
    refused = alice.lookup(PROMPT[:20] + [1, 2])
    assert (refused.session, refused.reason) == (None, "window")
    assert refused.diverged_at == 20  # where the request left the entry: the refused boundary
    assert alice.lookup(PROMPT[:40] + [1, 2]).reused == 40  # above the floor: a hit (control)


def test_disabled_cache(engine, prefix_factory) -> None:
    prefix = prefix_factory(engine.address, max_entries=0)
    gateway_round(prefix, max_new_tokens=1)
    second = gateway_round(prefix, max_new_tokens=1)
    assert second.done.reused_positions == 0
    assert PrefixClient(prefix.address).lookup(PROMPT).reason == "disabled"
    assert wait_for(lambda: engine.runner.resident_sessions == 0)
    # a disabled cache stores nothing, so it clones nothing: neither the gateway's prompt capture...
    assert engine.runner.metrics().clones_succeeded == 0
    # ...nor an Insert (refused, the caller's session untouched), which still checks the handle
    alice_engine, alice = (
        EngineClient(engine.address, owner="alice"),
        PrefixClient(prefix.address, owner="alice"),
    )
    own = (
        alice_engine.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    assert not alice.insert(PROMPT, own)
    assert engine.runner.metrics().clones_succeeded == 0 and alice_engine.describe(own)[0] == len(PROMPT)
    with pytest.raises(errors.NotFound):
        alice.insert(PROMPT, "not-a-handle")


def test_client_tolerates_a_miss_reason_it_does_not_know(engine, prefix_factory) -> None:
    # A newer service may add a MissReason; an older client reports it instead of raising KeyError.
    prefix = prefix_factory(engine.address)
    alice = PrefixClient(prefix.address, owner="alice")
    from protos import prefix_pb2

    alice.stub.Lookup = lambda request, **_: prefix_pb2.LookupResponse(tokens=[1, 2], reason=99)
    result = alice.lookup([1, 2])
    assert (result.session, result.reason) == (None, "unknown_99")


def test_token_ids_outside_the_engine_vocabulary_are_invalid_everywhere(engine, prefix_factory) -> None:
    # The gateway refuses them (the engine checks); Lookup and Insert must too, naming the field,
    # before any clone (nothing stored under ids the engine could never have computed).
    prefix = prefix_factory(engine.address)
    alice = PrefixClient(prefix.address, owner="alice")
    vocab = EngineClient(engine.address).info().vocab_size
    with pytest.raises(errors.InvalidArgument, match="tokens"):
        alice.lookup([65, vocab, 66])
    own = EngineClient(engine.address, owner="alice").generate(
        PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True
    )
    handle = own.collect().started.session
    clones = engine.runner.metrics().clones_succeeded
    with pytest.raises(errors.InvalidArgument, match="tokens"):
        alice.insert(PROMPT[:-1] + [vocab + 5], handle)  # the right length: only the id is wrong
    assert engine.runner.metrics().clones_succeeded == clones and alice.stats().entries == 0
    assert alice.insert(PROMPT, handle)  # control: the valid ids are stored


def test_lookup_whose_caller_gave_up_releases_its_clone(engine, prefix_factory) -> None:
    # The caller's deadline passes while the service looks up: the clone made for the caller would
    # never reach it, so the service closes it instead of leaving it to the idle timeout.
    import time

    prefix = prefix_factory(engine.address)
    alice = PrefixClient(prefix.address, owner="alice")
    alice.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    cache, real_lookup = prefix.cache, prefix.cache.lookup  # what the gateway calls

    def slow_lookup(namespace, tokens, **options):
        outcome = real_lookup(namespace, tokens, **options)
        time.sleep(0.5)
        return outcome

    cache.lookup = slow_lookup
    slow = PrefixClient(prefix.address, owner="alice", timeout=0.2)
    with pytest.raises(errors.Unavailable):  # DEADLINE_EXCEEDED
        slow.lookup(PROMPT)
    assert wait_for(lambda: cache.stats().hits == 1)  # the lookup did clone for alice
    assert wait_for(lambda: engine.deps.registry.count("alice") == 0, timeout=60), engine.deps.registry.count(
        "alice"
    )
    assert wait_for(lambda: engine.runner.resident_sessions == 1)  # only the stored snapshot
