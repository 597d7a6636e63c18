"""Prefix service over real sockets: the gateway's Generate (reuse, disconnects, metadata, the CLI
through both services, refusals before the lookup)."""

from __future__ import annotations

import pytest

from clients.engine_client import EngineClient, Started, Tokens
from clients.prefix_client import PrefixClient
from engine_service.api import errors
from engine_service.api.config import GenConfig
from protos import engine_pb2 as epb
from protos import prefix_pb2 as ppb
from tests.service.conftest import char_tokenizer
from tests.service.helpers import PROMPT, gateway_round, in_process_tokens, sampled, send_as_is, wait_for


def test_two_gateway_rounds_reuse_all_but_the_last_token(engine, prefix_factory) -> None:
    prefix = prefix_factory(engine.address, cache_generated=False)  # it counts the prompt snapshots
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


def test_a_gateway_continuation_of_the_answer_reuses_it(engine, prefix_factory) -> None:
    """The gRPC gateway stores the generated snapshot (the prompt and the answer but its pending last
    token): a prompt that continues the conversation reuses all of it and answers like a cold run."""
    prefix = prefix_factory(engine.address)
    first = gateway_round(prefix, **sampled(10))
    follow = PROMPT + first.tokens + [ord("?")]
    second = gateway_round(prefix, follow, **sampled(4))
    assert second.done.reused_positions == len(PROMPT) + 10 - 1
    assert second.tokens == in_process_tokens(follow, 4, temperature=10.0, seed=7)


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
