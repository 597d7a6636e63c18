"""A generation reserves positions as it grows (issue 21 item 4, the engine's half), over real gRPC
servers on port 0: ``position + input + min(max_new_tokens, growth)`` when it starts, ``growth`` more
each time it runs low, and finish reason "length" when its owner's quota has no room for the next step.

Before, a generation reserved ``position + input + max_new_tokens`` (at most a whole session) when it
started, so with the CLI's default quotas only 4 of 8 requests without a token limit (the HTTP door
sends a huge ``max_new_tokens`` then) started on a 32-session engine; the first and second tests fail
on that code (RESOURCE_EXHAUSTED at the start). The invariants (an owner never holds more than its
quota, a session never holds more positions than its reservation, everything is released at the
end, on cancel and on error) are watched from another thread for the whole of every test.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from clients.engine_client import EngineClient, Started, Tokens
from engine_service.api.config import GenConfig
from engine_service.api.errors import GenerationError, ResourceExhausted
from engine_service.api.owners import OwnerQuota
from engine_service.sessions.handles import HandleRegistry, engine_quotas
from engine_service.sessions.reservation import GROWTH, STEP_ROOM, GrowingReservation, default_growth
from tests.service.helpers import PROMPT, in_process_tokens, wait_for

NO_LIMIT = 1 << 30  # what the HTTP door sends as max_new_tokens for a request without max_tokens


class Watcher:
    """Checks the quota invariants of ``registry`` over and over on a thread of its own."""

    def __init__(self, registry: HandleRegistry) -> None:
        self.registry = registry
        self.problems: list[str] = []
        self.checks = 0
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        registry = self.registry
        while not self._stop.is_set():
            with registry._lock:  # a consistent view of every entry (test only)
                entries = [(e.owner, e.value, e.positions) for e in registry._entries.values()]
            held: dict[str, int] = {}
            for owner, session, weight in entries:
                held[owner] = held.get(owner, 0) + weight
                # the committed position is read after the weight: it only grows inside the reservation
                if session is not None and session.position > weight:
                    self.problems.append(f"{owner}: a session at {session.position} weighs {weight}")
            for owner, positions in held.items():
                self.peak[owner] = max(self.peak.get(owner, 0), positions)
                limit = registry.quota_for(owner).max_positions
                if limit and positions > limit:
                    self.problems.append(f"{owner} holds {positions} positions, quota {limit}")
            self.checks += 1
            time.sleep(0.002)

    @contextmanager
    def running(self) -> Iterator[Watcher]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(5)
        assert self.checks > 10 and not self.problems, self.problems[:5]


def test_the_rule_in_numbers() -> None:
    assert (default_growth(2048), default_growth(256), default_growth(64)) == (GROWTH, 32, 2 * STEP_ROOM)
    registry: HandleRegistry = HandleRegistry(quota=OwnerQuota(0, 400))
    other = registry.reserve("alice", 100)
    handle = registry.reserve("alice", 0)
    r = GrowingReservation(
        registry, handle, start=0, size=44, max_new_tokens=NO_LIMIT, max_session_tokens=2048, growth=256
    )
    assert (r.initial, r.target) == (44 + 256, 2048)
    registry.weigh(handle, r.initial, check=True)
    assert r.room_for_next_step(44 + 127) and r.held == 300  # 129 left: no need to grow yet
    assert r.room_for_next_step(44 + 129) and r.held == 300  # 127 left: asks for 256, 0 fit (100 + 300)
    assert registry.usage("alice").positions == 400
    registry.discard(other)  # room again: the next low update grows by 256 (capped by the quota: 400)
    assert r.room_for_next_step(44 + 130) and r.held == 400
    assert r.room_for_next_step(400 - STEP_ROOM) and not r.room_for_next_step(400 - STEP_ROOM + 1)
    small = GrowingReservation(
        registry, handle, start=10, size=5, max_new_tokens=20, max_session_tokens=2048, growth=256
    )
    assert small.initial == small.target == 35  # a bounded request reserves what it asks, once


def test_eight_requests_without_a_token_limit_all_finish_with_the_cli_defaults(engine_factory) -> None:
    quota, persistent = engine_quotas(32, 2048)
    assert quota == OwnerQuota(8, 8192)  # owner_max_sessions x max_session_tokens / 2
    engine = engine_factory(
        max_sessions=32, max_session_tokens=2048, quota=quota, persistent_quota=persistent
    )
    client = EngineClient(engine.address, owner="anonymous", timeout=300)
    prompt = PROMPT[:44]
    results: list[object] = [None] * 8

    def run(i: int) -> None:
        try:
            results[i] = client.generate(
                prompt, config=GenConfig(max_new_tokens=NO_LIMIT), ignore_eos=True
            ).collect()
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    with Watcher(engine.deps.registry).running() as watcher:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, failed  # before: 4 x "owner 'anonymous' holds 8192 positions and needs 2048 more"
    cold = in_process_tokens(prompt, GROWTH + 64)
    for out in results:
        assert out.done.finish_reason == "length"
        assert out.done.generated_tokens > len(cold)  # grew past its first reservation
        assert out.tokens[: len(cold)] == cold  # the answer, not garbage
    assert watcher.peak["anonymous"] <= 8192
    assert engine.deps.registry.usage("anonymous").positions == 0  # released at the end
    assert engine.deps.registry.usage("anonymous").sessions == 0


def test_an_owner_at_its_quota_gets_length_and_another_owner_is_unaffected(engine_factory) -> None:
    engine = engine_factory(max_session_tokens=256, quota=OwnerQuota(4, 200))  # growth 32
    alice = EngineClient(engine.address, owner="alice")
    bob = EngineClient(engine.address, owner="bob")
    kept = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )  # 90
    prompt = PROMPT[:20]
    outs: dict[str, object] = {}

    def run(name: str, client: EngineClient, max_new_tokens: int) -> None:
        try:
            outs[name] = client.generate(
                prompt, config=GenConfig(max_new_tokens=max_new_tokens), ignore_eos=True
            ).collect()
        except Exception as exc:  # noqa: BLE001 - reported below
            outs[name] = exc

    with Watcher(engine.deps.registry).running() as watcher:
        threads = [
            threading.Thread(target=run, args=("alice", alice, 1000)),  # reached 256 before: refused
            threading.Thread(target=run, args=("bob", bob, 150)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    long, other = outs["alice"], outs["bob"]
    assert not isinstance(long, Exception), long  # before: "holds 90 positions and needs 256 more"
    # alice's generation ended at her quota (90 held + 110), not at its token limit or the session's
    assert long.done.finish_reason == "length"
    assert 200 - 90 - STEP_ROOM - len(prompt) <= long.done.generated_tokens < 110 - len(prompt)
    assert long.done.position <= 200 - 90
    assert long.tokens == in_process_tokens(prompt, len(long.tokens))  # what it said is the answer's start
    assert watcher.peak["alice"] <= 200
    # bob: his own quota, his whole answer
    assert other.done.finish_reason == "length" and other.tokens == in_process_tokens(prompt, 150)
    # released: alice holds her kept session only, and can still run what fits
    assert engine.deps.registry.usage("alice").positions == 90
    assert alice.generate(prompt, config=GenConfig(max_new_tokens=50)).collect().done.generated_tokens == 50
    alice.close(kept)


def test_negative_control_without_a_positions_quota_the_same_generation_runs_to_the_session_end(
    engine_factory,
) -> None:
    engine = engine_factory(max_session_tokens=256, quota=OwnerQuota(4, 0))
    alice = EngineClient(engine.address, owner="alice")
    alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True).collect()
    out = alice.generate(PROMPT[:20], config=GenConfig(max_new_tokens=1000), ignore_eos=True).collect()
    assert out.done.finish_reason == "length" and out.done.position == 256  # the session is full


def test_a_request_whose_first_reservation_does_not_fit_is_refused_before_anything_runs(
    engine_factory,
) -> None:
    engine = engine_factory(max_session_tokens=256, quota=OwnerQuota(4, 100))
    alice = EngineClient(engine.address, owner="alice")
    kept = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )  # 90
    with pytest.raises(
        ResourceExhausted, match=r"holds 90 positions and needs 52 more, owner_max_positions=100"
    ):
        alice.generate(
            PROMPT[:20], config=GenConfig(max_new_tokens=NO_LIMIT)
        ).collect()  # 20 + 32 at the start
    assert engine.deps.registry.usage("alice").positions == 90
    alice.close(kept)


def test_many_owners_growing_cancelling_and_failing_concurrently_keep_the_invariants(
    engine_factory, monkeypatch
) -> None:
    engine = engine_factory(max_sessions=32, max_session_tokens=256, quota=OwnerQuota(8, 600))
    owners = ("alice", "bob", "carol")
    rng = random.Random(7)
    plans = [
        (owner, i, rng.choice([5, 40, 150, NO_LIMIT]), rng.random()) for owner in owners for i in range(7)
    ]
    # a few generations fail mid-way: the executor raises on one batch (every generation in it fails)
    executor = engine.runner._engine._executor
    execute, batches = executor.execute, [0]

    def flaky(batch):
        batches[0] += 1
        if batches[0] == 40:
            raise RuntimeError("injected failure")
        return execute(batch)

    monkeypatch.setattr(executor, "execute", flaky)
    outcomes: dict[tuple[str, int], str] = {}

    def run(owner: str, i: int, max_new: int, luck: float) -> None:
        client = EngineClient(engine.address, owner=owner)
        try:
            stream = client.generate(
                PROMPT[: 10 + i], config=GenConfig(max_new_tokens=max_new), ignore_eos=True
            )
            if luck < 0.3:  # the client goes away after a few tokens
                seen = 0
                for event in stream:
                    seen += isinstance(event, Tokens)
                    if seen >= 3 or not isinstance(event, (Started, Tokens)):
                        break
                stream.cancel()
                outcomes[(owner, i)] = "cancelled"
            else:
                outcomes[(owner, i)] = stream.collect().done.finish_reason.value
        except GenerationError:
            outcomes[(owner, i)] = "error"
        except ResourceExhausted as exc:  # the quota momentarily full at the start: refused, nothing held
            outcomes[(owner, i)] = f"refused: {exc}"

    with Watcher(engine.deps.registry).running():
        threads = [threading.Thread(target=run, args=plan) for plan in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(outcomes) == len(plans)
    kinds = {v.split(":")[0] for v in outcomes.values()}
    assert {"length", "cancelled", "error"} <= kinds, outcomes
    assert kinds <= {"length", "stop", "cancelled", "error", "refused"}, outcomes
    registry = engine.deps.registry
    assert wait_for(lambda: all(registry.usage(o).positions == 0 for o in owners)), [
        registry.usage(o) for o in owners
    ]
    assert all(registry.usage(o).sessions == 0 for o in owners)
    assert wait_for(lambda: engine.runner.resident_sessions == 0)
