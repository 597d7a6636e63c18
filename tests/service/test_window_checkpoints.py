"""Sliding-window reuse beyond the window, over real gRPC servers (tiny FRFR model, window 4, prefill
chunk 64 = max_write 64: a ring keeps 67 rows, so a snapshot of n positions clones only at >= n - 64).

- the engine says why a clone below a ring's floor is refused (CLONE_REFUSAL_WINDOW) and publishes
  its window geometry in Info;
- a prompt diverging inside a stored 200-token prompt, past the window, reuses the longest checkpoint
  at or before the divergence on batched-sequence, and its tokens equal a cold run's (an in-process
  Runner, no gRPC, no prefix cache);
- with checkpoints off the same request is a ``window`` miss (Lookup reason, Stats, metrics): the
  negative control;
- batched-cell needs no checkpoints: the stored prompt clones at the divergence itself;
- a chat prompt's message end is a checkpoint: a new question after the same system prompt reuses
  the system prompt exactly.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import pytest

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.executors.module import ModuleExecutor
from engine_service.model.random_init import random_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.runtime.runner import Runner
from prefix_service.cache.checkpoints import CheckpointPlan
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.metrics import GatewayCollector
from prefix_service.rpc.server import create_server as create_prefix_server
from prefix_service.tier.persistent_tier import PersistentTier
from protos import engine_pb2 as epb
from protos import prefix_pb2 as ppb
from tests.service.conftest import Prefix
from tests.service.helpers import wait_for

A = [3 + (i * 37) % 120 for i in range(200)]  # a stored 200-token prompt
DIVERGE = 120  # A[120] == 3; past the window and more than max_write below A's end (floor 136)
B = A[:DIVERGE] + [100 + i % 20 for i in range(60)]  # shares exactly A's first 120 tokens
NEW_TOKENS = 8
SAMPLING = GenConfig(
    max_new_tokens=NEW_TOKENS, temperature=10.0, seed=7
)  # the tiny random model is very peaked


@lru_cache(maxsize=8)
def cold(prompt: tuple[int, ...], cache_kind: str) -> tuple[int, ...]:
    """The independent reference: the same tiny model in a fresh in-process Runner, no prefix cache."""
    executor = ModuleExecutor.create(random_model("FRFR", 4, 0), cache_kind, 2, 1024, prefill_chunk=64)
    runner = Runner(executor)
    try:
        with runner.open_session() as session:
            return session.generate_async(list(prompt), SAMPLING).wait(60).tokens
    finally:
        runner.shutdown()


@pytest.fixture
def start_prefix():
    started: list[Prefix] = []

    def make(engine_address: str, checkpoints: CheckpointPlan, tier=None) -> Prefix:
        gateway, channel = connect_engine(  # prompts and their checkpoints only: the tests count them
            engine_address, max_entries=16, checkpoints=checkpoints, tier=tier, cache_generated=False
        )
        server, port = create_prefix_server(gateway, "127.0.0.1:0", channel=channel)
        started.append(Prefix(server, port))
        return started[-1]

    yield make
    for prefix in started:
        prefix.stop(0, release=False)


def gateway_round(prefix: Prefix, prompt, **kwargs):
    client = PrefixClient(prefix.address, owner="alice")
    return client.generate(prompt, config=SAMPLING, ignore_eos=True, **kwargs).collect()


def stored(prefix: Prefix) -> dict[int, str]:
    return {len(e.tokens): e.metadata.get("boundary", "prompt") for e in prefix.cache.entries()}


def misses_by_reason(prefix: Prefix) -> dict[str, int]:
    """StatsResponse.misses_by_reason, over gRPC."""
    client = PrefixClient(prefix.address)
    return dict(client._unary(client.stub.Stats, ppb.StatsRequest()).misses_by_reason)


def misses_metric(prefix: Prefix) -> dict[str, float]:
    family = next(
        f for f in GatewayCollector(prefix.server.fleet).collect() if f.name == "forkline_prefix_misses"
    )
    return {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_the_engine_names_window_refusals_and_publishes_its_geometry(engine_factory) -> None:
    for kind, evicts in (("batched-sequence", True), ("batched-cell", False)):
        engine = engine_factory(cache_kind=kind, max_session_tokens=512)
        client = EngineClient(engine.address, owner="alice")
        info = client.stub.Info(epb.InfoRequest(), metadata=(("forkline-owner", "alice"),))
        assert (info.cache_kind, info.window.sliding_window, info.window.max_write, info.window.evicts) == (
            kind,
            4,
            64,
            evicts,
        )
        snapshot = (
            client.generate(A, config=GenConfig(max_new_tokens=1), prompt_snapshot=True)
            .collect()
            .snapshots[0]
            .handle
        )
        below = client.clone_detailed(snapshot, DIVERGE)  # 120 < 200 - 64
        above = client.clone_detailed(snapshot, 140)
        assert above.session and above.reason == epb.CLONE_REFUSAL_UNSPECIFIED
        if evicts:
            assert (below.session, below.reason) == ("", epb.CLONE_REFUSAL_WINDOW)
            assert "sliding-window floor" in below.refusal
        else:  # every cell stays: a clone at any committed position works
            assert below.session and below.position == DIVERGE


def test_a_divergence_inside_a_stored_prompt_reuses_the_longest_checkpoint_before_it(
    engine_factory, start_prefix
) -> None:
    engine = engine_factory(max_session_tokens=512, max_sessions=32)  # the cache's share: 16 entries
    prefix = start_prefix(engine.address, CheckpointPlan(stride=96))  # stride > max_write: gaps
    first = gateway_round(prefix, A)
    assert first.done.reused_positions == 0
    assert stored(prefix) == {96: "breakpoint", 192: "breakpoint", 200: "prompt"}
    second = gateway_round(prefix, B)
    # 200 (floor 136) and 192 (floor 128) cannot clone at 120: the checkpoint at 96 serves
    assert second.done.reused_positions == 96
    assert second.tokens == list(cold(tuple(B), "batched-sequence"))
    assert first.tokens == list(cold(tuple(A), "batched-sequence"))
    assert misses_by_reason(prefix) == {"empty": 1} and PrefixClient(prefix.address).stats().hits == 1
    # every session the engine still holds is a stored entry (A's three, B's prompt)
    assert wait_for(lambda: engine.runner.resident_sessions == len(prefix.cache))


def test_a_stride_within_max_write_reuses_every_shared_position(engine_factory, start_prefix) -> None:
    engine = engine_factory(max_session_tokens=512, max_sessions=32)  # the cache's share: 16 entries
    prefix = start_prefix(engine.address, CheckpointPlan(stride=32))
    gateway_round(prefix, A)
    assert set(stored(prefix)) == {32, 64, 96, 128, 160, 192, 200}
    second = gateway_round(prefix, B)
    assert second.done.reused_positions == DIVERGE  # a later checkpoint (160, floor 96) rewinds to 120
    assert second.tokens == list(cold(tuple(B), "batched-sequence"))


def test_without_checkpoints_the_divergence_is_a_window_miss(engine_factory, start_prefix) -> None:
    engine = engine_factory(max_session_tokens=512)
    prefix = start_prefix(engine.address, CheckpointPlan(max_checkpoints=0))
    gateway_round(prefix, A)
    assert stored(prefix) == {200: "prompt"}
    client = PrefixClient(prefix.address, owner="alice")
    lookup = client.lookup(B)
    assert (lookup.session, lookup.reason, lookup.diverged_at) == (None, "window", DIVERGE)
    second = gateway_round(prefix, B)
    assert second.done.reused_positions == 0  # computed from scratch, like llama.cpp's cache_n 0
    assert second.tokens == list(cold(tuple(B), "batched-sequence"))
    assert misses_by_reason(prefix) == {"empty": 1, "window": 2}
    assert misses_metric(prefix) == {"empty": 1.0, "window": 2.0}
    assert client.lookup(A[:150] + [5, 6]).reused == 150  # above the floor: a hit (control)


def test_batched_cell_reuses_up_to_the_divergence_without_checkpoints(engine_factory, start_prefix) -> None:
    engine = engine_factory(cache_kind="batched-cell", max_session_tokens=512)
    prefix = start_prefix(engine.address, CheckpointPlan(stride=32))
    first = gateway_round(prefix, A)
    assert stored(prefix) == {200: "prompt"}  # Info says the cache keeps every row: none asked for
    assert first.tokens == list(cold(tuple(A), "batched-cell"))
    second = gateway_round(prefix, B)
    assert second.done.reused_positions == DIVERGE
    assert second.tokens == list(cold(tuple(B), "batched-cell"))


def test_a_chat_message_end_is_a_checkpoint(engine_factory, start_prefix) -> None:
    engine = engine_factory(max_session_tokens=512, max_sessions=32)
    prefix = start_prefix(engine.address, CheckpointPlan())  # the defaults: message ends, branch points
    system = "You are a terse assistant. " * 4  # 108 characters: one token each
    first = gateway_round(prefix, None, text="q" * 80, chat=True, system=system)
    chat = ChatFormatter(name="chatml")
    rendered = chat.format([{"role": "system", "content": system}, {"role": "user", "content": "q" * 80}])
    assert first.done.prompt_positions == len(rendered) == 268  # no stride point (256) by default
    system_end = len(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>")
    assert stored(prefix) == {system_end: "breakpoint", len(rendered): "prompt"}
    second = gateway_round(prefix, None, text="r" * 80, chat=True, system=system)
    # the new question diverges 5 positions after the system message ("user\n"); the prompt (268)
    # is more than max_write past it
    assert second.done.reused_positions == system_end
    again = chat.format([{"role": "system", "content": system}, {"role": "user", "content": "r" * 80}])
    assert second.tokens == list(cold(tuple(ord(c) for c in again), "batched-sequence"))


def engine_calls(engine) -> Counter[str]:
    """The engine RPCs handled so far, by method (health checks left out)."""
    calls: Counter[str] = Counter()
    for metric in engine.server.metrics.registry.collect():
        if metric.name == "forkline_rpc_requests":
            for sample in metric.samples:
                if sample.name.endswith("_total") and "Health" not in sample.labels["service"]:
                    calls[sample.labels["method"]] += int(sample.value)
    return calls


def test_a_chat_costs_the_same_engine_calls_on_a_sliding_and_a_full_attention_engine(
    engine_factory, start_prefix
) -> None:
    """The message ends a sliding engine's checkpoints need come with the prompt's one Tokenize, so a
    chat (a hit, and a new turn) makes the calls a full-attention engine makes (which also clones a
    branch point where the new turn diverged)."""
    system = "You are a terse assistant. " * 4  # a system message and a question: one message end
    counted, reused = {}, {}
    for layers in ("FRFR", "FFFF"):  # ring layers evict rows; full layers never do
        engine = engine_factory(layers=layers, max_session_tokens=512, max_sessions=32, metrics=True)
        prefix = start_prefix(engine.address, CheckpointPlan())

        def ask(question: str, prefix=prefix):
            return gateway_round(prefix, None, text=question, chat=True, system=system)

        ask("q" * 80)
        before = engine_calls(engine)
        hit = ask("q" * 80)
        hit_calls = engine_calls(engine) - before
        before = engine_calls(engine)
        turn = ask("r" * 80)  # a new question after the same system prompt
        counted[layers] = (hit_calls, engine_calls(engine) - before)
        reused[layers] = turn.done.reused_positions
        assert hit.done.prompt_positions == 1 and hit.done.reused_positions == 267  # a full hit
    # Claim takes over each stored snapshot after the stream: a sliding engine also stores checkpoints
    ahead = {
        layers: [Counter({m: n for m, n in c.items() if m != "Claim"}) for c in calls]
        for layers, calls in counted.items()
    }
    assert (
        ahead["FRFR"][0] == ahead["FRFR"][1] == ahead["FFFF"][0] == Counter(Tokenize=1, Clone=1, Generate=1)
    )
    # the full-attention engine's new turn also keeps a branch point where it left the stored prompt
    # (one more Clone, at insert time: sharing.py); the ring's would be past both snapshots' reach
    assert ahead["FFFF"][1] == Counter(Tokenize=1, Clone=2, Generate=1)
    # ... and the one Tokenize carried the message end: the new question reuses the system prompt
    system_end = len(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>")
    assert reused == {"FRFR": system_end, "FFFF": system_end + len("user\n")}


def test_checkpoints_are_entries_of_the_budget_and_the_retention_policy(engine_factory, start_prefix) -> None:
    """8 engine sessions, a share of 0.5: the cache holds 4 entries, so one prompt gets one checkpoint
    (with its prompt snapshot, half the cache): of the stride points 32 .. 192 the last. The least
    recently used entry -- the checkpoint, stored before its prompt -- is evicted like any other and
    released in the engine; the divergence it served becomes a window miss."""
    engine = engine_factory(max_session_tokens=512, max_sessions=8)
    prefix = start_prefix(engine.address, CheckpointPlan(stride=32))
    gateway_round(prefix, A)
    assert stored(prefix) == {192: "breakpoint", 200: "prompt"}
    stats = PrefixClient(prefix.address).stats()
    # the checkpoint and the prompt snapshot share their flat rows (half of FRFR's layers): the
    # checkpoint's flat half is counted once, under the prompt's positions
    assert (stats.max_entries, stats.entries, stats.positions) == (4, 2, 200 + 192 // 2)
    b130 = tuple(A[:130] + [100 + i % 20 for i in range(50)])  # 192's floor is 128, 200's 136
    assert prefix.cache.reusable("", b130) == 130  # served by the checkpoint (no clone, no refresh)
    gateway_round(prefix, [5 + i % 7 for i in range(70)])  # its snapshot and its checkpoint at 64
    assert len(prefix.cache) == 4 and prefix.cache.stats().evictions == 0
    gateway_round(prefix, [9 + i % 5 for i in range(30)])  # one more entry: the LRU one goes
    assert prefix.cache.stats().evictions == 1
    assert tuple(A[:192]) not in {e.tokens for e in prefix.cache.entries()}
    assert tuple(A) in {e.tokens for e in prefix.cache.entries()}
    assert wait_for(lambda: engine.runner.resident_sessions == 4)  # the evicted snapshot was released
    lookup = PrefixClient(prefix.address, owner="alice").lookup(list(b130))
    assert (lookup.reason, lookup.diverged_at) == ("window", 130)


def test_a_window_divergence_imports_no_snapshot_file(engine_factory, start_prefix, tmp_path) -> None:
    """With --snapshot_dir, a lookup first restores the folder's best prefix when memory cannot
    reuse as much: a file the ring could not clone at the divergence either must not count, or every
    such lookup would import A's file again (and drop it as a duplicate)."""
    engine = engine_factory(max_session_tokens=512)
    tier = PersistentTier.open(str(tmp_path), 1 << 30)
    try:
        prefix = start_prefix(engine.address, CheckpointPlan(stride=0), tier=tier)
        gateway_round(prefix, A)
        assert tier.writer.flush(10) and tier.store.stats().written == 1
        client = PrefixClient(prefix.address, owner="alice")
        assert client.lookup(B).reason == "window"
        assert client.lookup(A[:150] + [5, 6]).reused == 150  # control: the memory entry serves
        stats = tier.store.stats()
        assert (stats.restored, stats.refused) == (0, 0)
        assert engine.runner.metrics().clones_refused == 0  # the walk made no clone call it knew would fail
    finally:
        tier.stop()
