"""Prefix service over real sockets: gateway reuse, Lookup/Insert/Stats/Clear, miss reasons, faults."""

from __future__ import annotations

import pytest

from clients.engine_client import EngineClient, Started, Tokens
from clients.prefix_client import PrefixClient
from engine_service.api import errors
from engine_service.api.config import GenConfig
from protos import engine_pb2 as epb
from protos import prefix_pb2 as ppb
from tests.service.conftest import char_tokenizer
from tests.service.helpers import PROMPT, in_process_tokens, sampled, send_as_is, wait_for


def gateway_round(prefix, prompt=PROMPT, max_new_tokens=10, **kw):
    kw.setdefault("config", GenConfig(max_new_tokens=max_new_tokens))
    return PrefixClient(prefix.address, owner="alice").generate(prompt, **kw).collect()


def test_two_gateway_rounds_reuse_all_but_the_last_token(engine, prefix_factory) -> None:
    prefix = prefix_factory(engine.address)
    first = gateway_round(prefix, **sampled(10))
    second = gateway_round(prefix, **sampled(10))
    assert (first.done.reused_positions, first.done.prompt_positions) == (0, len(PROMPT))
    assert (second.done.reused_positions, second.done.prompt_positions) == (len(PROMPT) - 1, 1)
    reference = in_process_tokens(PROMPT, 10, temperature=10.0, seed=7)
    assert first.tokens == reference and second.tokens == reference and len(set(reference)) > 1
    assert second.text == first.text
    assert first.started.session == ""  # the service's session is not handed out
    stats = PrefixClient(prefix.address).stats()
    assert (stats.entries, stats.hits, stats.misses, stats.inserts, stats.reused_positions) == (
        1,
        1,
        1,
        1,
        len(PROMPT) - 1,
    )
    # resident: only the stored snapshot (generation sessions and lookup clones were closed)
    assert wait_for(lambda: engine.runner.resident_sessions == 1)
    # an extended prompt reuses the stored prefix
    longer = gateway_round(prefix, PROMPT + [ord("!")] * 5, **sampled(10))
    assert longer.done.reused_positions == len(PROMPT)
    assert longer.tokens == in_process_tokens(PROMPT + [ord("!")] * 5, 10, temperature=10.0, seed=7)


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


def test_killed_prefix_service_is_cleaned_up_by_its_restart(engine, prefix_factory) -> None:
    base = engine.runner.resident_sessions
    prefix = prefix_factory(engine.address)
    for i in range(3):
        gateway_round(prefix, PROMPT[i:], max_new_tokens=2)
    assert wait_for(lambda: engine.runner.resident_sessions == base + 3)
    # a client is mid-stream when the service dies without releasing anything
    stream = PrefixClient(prefix.address, owner="alice").generate(
        PROMPT, config=GenConfig(max_new_tokens=3000), ignore_eos=True
    )
    events = iter(stream)
    next(events)
    prefix.stop(grace=0, release=False)
    with pytest.raises(errors.ForklineError):
        for _ in events:
            pass
    # the 3 snapshots are orphaned in the engine, possibly with the clone the dead stream ran on and
    # that stream's duplicate prompt snapshot (killed before it could release them)
    assert wait_for(lambda: base + 3 <= engine.runner.resident_sessions <= base + 5), (
        engine.runner.resident_sessions
    )
    restarted = prefix_factory(engine.address)  # same owner id: releases what the first one left
    assert wait_for(lambda: engine.runner.resident_sessions == base), engine.runner.resident_sessions
    # ...and caches again
    gateway_round(restarted, max_new_tokens=2)
    assert gateway_round(restarted, max_new_tokens=2).done.reused_positions == len(PROMPT) - 1


def test_engine_restart_is_a_safe_miss_then_caches_again(engine_factory, prefix_factory) -> None:
    engine = engine_factory()
    prefix = prefix_factory(engine.address)
    gateway_round(prefix, max_new_tokens=2)
    assert gateway_round(prefix, max_new_tokens=2).done.reused_positions == len(PROMPT) - 1
    old_instance = PrefixClient(prefix.address).stats().engine_instance_id
    engine.stop(grace=0)
    engine = engine_factory(port=engine.port)  # a new engine process on the same address
    alice = PrefixClient(prefix.address, owner="alice")
    miss = alice.lookup(PROMPT)
    assert (miss.session, miss.reason) == (None, "engine_restarted")
    stats = alice.stats()
    assert stats.entries == 0 and stats.dropped_on_restart == 1 and stats.engine_instance_id != old_instance
    first = gateway_round(prefix, max_new_tokens=4)
    second = gateway_round(prefix, max_new_tokens=4)
    assert (first.done.reused_positions, second.done.reused_positions) == (0, len(PROMPT) - 1)
    assert first.tokens == second.tokens == in_process_tokens(PROMPT, 4)


def test_gateway_client_disconnect_frees_the_generation(engine_factory, prefix_factory) -> None:
    engine = engine_factory(max_session_tokens=4096)
    prefix = prefix_factory(engine.address)
    gateway_round(prefix, max_new_tokens=1)  # one stored snapshot
    assert wait_for(lambda: engine.runner.resident_sessions == 1)
    stream = PrefixClient(prefix.address, owner="alice").generate(
        PROMPT, config=GenConfig(max_new_tokens=3000), ignore_eos=True
    )
    events = iter(stream)
    assert isinstance(next(events), Started)
    assert isinstance(next(events), Tokens)
    # the stored snapshot + the generating clone (the duplicate prompt snapshot is released)
    assert wait_for(lambda: engine.runner.resident_sessions == 2)
    stream.cancel()
    assert wait_for(lambda: engine.runner.resident_sessions == 1)
    assert EngineClient(engine.address).info().open_handles == 1


def test_cli_rounds_through_the_services(engine, prefix_factory, tmp_path, capsys) -> None:
    from clients.run_llm_batched import _main  # main() also releases MLX streams at exit

    prefix = prefix_factory(engine.address)
    prompt = "The quick brown fox jumps over the lazy dog."
    argv = [
        "--engine",
        engine.address,
        "--prefix",
        prefix.address,
        "--prompt_rounds",
        "2",
        "--max_new_tokens",
        "6",
        "--max_session_tokens",
        "256",
        "--out_prefix",
        str(tmp_path / "gen"),
        prompt,
    ]
    assert _main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    n = len(prompt) + 1  # one token per character, plus BOS
    assert f"reused 0/{n} prompt tokens" in lines[0] and f"reused {n - 1}/{n} prompt tokens" in lines[1]
    texts = [(tmp_path / f"gen_{i}.txt").read_text() for i in range(2)]
    reference = in_process_tokens([1, *map(ord, prompt)], 6, temperature=0.0, seed=42)
    assert texts[0] == texts[1] == char_tokenizer().decode(reference, skip_special_tokens=True)


def test_prefix_errors_map_to_codes(engine_factory, prefix_factory) -> None:
    engine = engine_factory()
    prefix = prefix_factory(engine.address)
    alice = PrefixClient(prefix.address, owner="alice")
    with pytest.raises(errors.NotFound):
        alice.insert(PROMPT, "not-a-handle")
    with pytest.raises(errors.InvalidArgument):
        alice.insert([], "x")
    with pytest.raises(errors.InvalidArgument):
        alice.generate([65, -3], config=GenConfig(max_new_tokens=1)).collect()
    with pytest.raises(errors.InvalidArgument):
        alice.generate(
            [65] * 300, config=GenConfig(max_new_tokens=1)
        ).collect()  # over max_session_tokens (256)
    with pytest.raises(errors.InvalidArgument):
        zero = epb.GenerationConfig(max_new_tokens=0)
        send_as_is(alice, ppb.GatewayGenerateRequest(tokens=epb.TokenIds(ids=PROMPT), config=zero))
    assert gateway_round(prefix, max_new_tokens=2).done.generated_tokens == 2  # still serving
    assert wait_for(lambda: engine.runner.resident_sessions == 1)  # only the stored snapshot
    engine.stop(grace=0)
    with pytest.raises(errors.Unavailable):
        alice.lookup(PROMPT)


@pytest.mark.parametrize(("policy", "kept"), [("priority", "high"), ("lru", "low")])
def test_gateway_metadata_reaches_the_retention_policy(engine_factory, prefix_factory, policy, kept) -> None:
    engine = engine_factory()
    prefix = prefix_factory(engine.address, max_entries=1, policy=policy)
    prompts = {"high": PROMPT, "low": [ord(c) for c in "Another prompt entirely, with its own words."]}
    gateway_round(prefix, prompts["high"], max_new_tokens=1, metadata={"priority": "5"})
    gateway_round(prefix, prompts["low"], max_new_tokens=1, metadata={"priority": "0"})
    alice = PrefixClient(prefix.address, owner="alice")
    hits = {name: alice.lookup(tokens).session is not None for name, tokens in prompts.items()}
    assert hits == {"high": kept == "high", "low": kept == "low"}
    assert alice.stats().policy == policy


def test_snapshot_the_engine_no_longer_holds_is_dropped_not_kept(engine_factory, prefix_factory) -> None:
    # The engine no longer holds a stored snapshot (someone released the service's handles behind its
    # back). The entry must not linger: a lookup drops it (stats match what the engine holds) and the
    # same prompt can be cached again.
    engine = engine_factory(idle_timeout_s=0.3)
    prefix = prefix_factory(engine.address)
    gateway_round(prefix, max_new_tokens=2)
    assert len(prefix.cache) == 1
    for released in engine.deps.registry.release_owner("prefix-service"):
        released.value.close()
    alice = PrefixClient(prefix.address, owner="alice")
    assert alice.lookup(PROMPT).session is None
    assert alice.stats().entries == 0 and prefix.server.deps.backend.sessions.held() == 0
    again = gateway_round(prefix, max_new_tokens=2)  # stores a fresh snapshot
    assert again.done.reused_positions == 0 and alice.stats().entries == 1
    assert gateway_round(prefix, max_new_tokens=2).done.reused_positions == len(PROMPT) - 1


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


class _GatedStub:
    """The gateway's engine stub, except that a Generate call hands over only its first event until
    ``gate`` opens: events the engine already sent wait, unread, in the gateway's channel."""

    def __init__(self, stub, gate) -> None:
        self._stub, self._gate = stub, gate

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def Generate(self, *args, **kwargs):
        call, gate = self._stub.Generate(*args, **kwargs), self._gate

        class Gated:
            def __init__(self) -> None:
                self.first = True

            def __iter__(self):
                return self

            def __next__(self):
                if not self.first:
                    gate.wait(10)
                self.first = False
                return next(call)

            def cancel(self):
                return call.cancel()

        return Gated()


def test_gateway_client_gone_while_its_snapshot_is_in_flight_leaks_nothing(
    engine_factory, prefix_factory
) -> None:
    # The engine has sent the prompt snapshot (a prefix-service handle) but the gateway has not read
    # it yet when its client disconnects. Whatever the gateway does, the engine must end up holding
    # exactly the snapshots the cache stores.
    import threading

    engine = engine_factory(max_session_tokens=4096)
    prefix = prefix_factory(engine.address)
    gate = threading.Event()
    backend = prefix.server.deps.backend
    backend.connection.stub = _GatedStub(backend.connection.stub, gate)
    stream = PrefixClient(prefix.address, owner="alice").generate(
        PROMPT, config=GenConfig(max_new_tokens=3000), ignore_eos=True
    )
    events = iter(stream)
    assert isinstance(next(events), Started)
    # the generating session (the caller's: it runs as alice) and the snapshot (the service's), both sent
    assert wait_for(
        lambda: (engine.deps.registry.count("alice"), engine.deps.registry.count("prefix-service")) == (1, 1)
    )
    stream.cancel()
    assert wait_for(lambda: engine.runner.metrics().generations_finished == 1)  # the engine saw the client go
    gate.set()

    def settled():
        return (
            engine.deps.registry.count("prefix-service"),
            engine.runner.resident_sessions,
            backend.sessions.held(),
        )

    assert wait_for(lambda: settled() == (len(prefix.cache),) * 3), (settled(), len(prefix.cache))


def test_gateway_refuses_bad_requests_before_its_lookup(engine, prefix_factory) -> None:
    # A request the engine will refuse must not clone a snapshot nor count as a hit that reused
    # positions: the gateway validates the config and the prompt length first.
    prefix = prefix_factory(engine.address)
    alice = PrefixClient(prefix.address, owner="alice")
    alice.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    before, clones = alice.stats(), engine.runner.metrics().clones_succeeded
    for kw in (dict(top_p=2.0), dict(max_new_tokens=0), dict(temperature=float("nan"))):
        request = ppb.GatewayGenerateRequest(
            tokens=epb.TokenIds(ids=PROMPT + [65]), config=epb.GenerationConfig(**kw)
        )
        with pytest.raises(errors.InvalidArgument):
            send_as_is(alice, request)
    with pytest.raises(errors.InvalidArgument, match="max_session_tokens"):
        alice.generate(
            PROMPT + [65] * 200, config=GenConfig(max_new_tokens=1)
        ).collect()  # 290 > 256 positions
    after = alice.stats()
    assert (after.hits, after.misses, after.reused_positions) == (
        before.hits,
        before.misses,
        before.reused_positions,
    )
    assert engine.runner.metrics().clones_succeeded == clones
    # control: a valid request hits
    assert alice.generate(
        PROMPT + [65], config=GenConfig(max_new_tokens=1)
    ).collect().done.reused_positions == len(PROMPT)


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
