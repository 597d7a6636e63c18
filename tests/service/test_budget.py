"""The prefix service never starves live traffic (issue 10 item 3), over real gRPC servers on port 0.

Reproduces the starvation defect: with the service allowed the whole engine (share 1.0) and no retry
(the behaviour before the budget), distinct prompts through the gateway fill the engine with stored
snapshots and live clients get RESOURCE_EXHAUSTED, on the gateway (even for a cached prompt) and on
the engine. With the defaults (share 0.5 of the engine's sessions and positions, evict-and-retry under
pressure, the engine's quotas) the same load gives them none.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError, ResourceExhausted
from engine_service.api.owners import NO_QUOTA
from engine_service.sessions.handles import engine_quotas
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import create_server as create_prefix_server
from tests.service.conftest import Engine, Prefix
from tests.service.helpers import PROMPT

MAX_SESSIONS = 12
MAX_SESSION_TOKENS = 256
DISTINCT_PROMPTS = 200


def prompt(i: int) -> list[int]:
    return [ord(c) for c in f"Distinct prompt number {i:03d}: tell me something new."]


@pytest.fixture
def services(engine_factory) -> Iterator[Callable[..., tuple[Engine, Prefix]]]:
    """``services(quotas=..., engine_share=..., pressure_retry=...)``: an engine of MAX_SESSIONS
    sessions (with the CLI's default quotas, or none) and a prefix service over it."""
    started: list[Prefix] = []

    def make(*, quotas: bool, engine_share: float, pressure_retry: bool) -> tuple[Engine, Prefix]:
        quota, persistent = (
            engine_quotas(MAX_SESSIONS, MAX_SESSION_TOKENS) if quotas else (NO_QUOTA, NO_QUOTA)
        )
        engine = engine_factory(
            max_sessions=MAX_SESSIONS,
            max_session_tokens=MAX_SESSION_TOKENS,
            quota=quota,
            persistent_quota=persistent,
        )
        gateway, channel = connect_engine(
            engine.address, max_entries=64, engine_share=engine_share, pressure_retry=pressure_retry
        )
        prefix = Prefix(*create_prefix_server(gateway, "127.0.0.1:0", channel=channel))
        started.append(prefix)
        return engine, prefix

    yield make
    for prefix in started:
        prefix.stop(0)


@dataclass
class Tally:
    calls: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def run(self, call: Callable[[], object]) -> None:
        try:
            call()
        except ResourceExhausted:
            self.errors["RESOURCE_EXHAUSTED"] += 1
        except ForklineError as exc:
            self.errors[type(exc).__name__] += 1
        self.calls += 1


def live_clients(
    engine: Engine, prefix: Prefix, stop: threading.Event
) -> tuple[list[threading.Thread], dict]:
    """Three clients that keep generating until ``stop``: one on the engine (fresh sessions), one on the
    engine keeping its session and continuing it, one through the gateway (a prompt cached after its
    first call)."""
    tallies = {"engine": Tally(), "engine-kept": Tally(), "gateway": Tally()}
    direct = EngineClient(engine.address, owner="client-a")
    keeper = EngineClient(engine.address, owner="client-b")
    gatewayed = PrefixClient(prefix.address, owner="client-c")

    def kept_round() -> None:
        session = (
            keeper.generate(PROMPT, config=GenConfig(max_new_tokens=2), keep_session=True)
            .collect()
            .started.session
        )
        try:
            keeper.generate([65, 66], session=session, config=GenConfig(max_new_tokens=2)).collect()
        finally:
            keeper.close(session)

    rounds = {
        "engine": lambda: direct.generate(PROMPT, config=GenConfig(max_new_tokens=2)).collect(),
        "engine-kept": kept_round,
        "gateway": lambda: gatewayed.generate(PROMPT, config=GenConfig(max_new_tokens=2)).collect(),
    }

    def loop(name: str) -> None:
        while not stop.wait(0.02):  # a short think time between calls: load, not a CPU race on two cores
            tallies[name].run(rounds[name])

    return [threading.Thread(target=loop, args=(name,), daemon=True) for name in rounds], tallies


def load(
    engine: Engine,
    prefix: Prefix,
    enough: Callable[[dict[str, Tally], Tally], bool] = lambda tallies, loader: False,
) -> tuple[dict[str, Tally], Tally]:
    """DISTINCT_PROMPTS prompts through the gateway while the three clients keep generating (stops
    early once ``enough(tallies, loader)``)."""
    stop = threading.Event()
    threads, tallies = live_clients(engine, prefix, stop)
    for thread in threads:
        thread.start()
    loader, tally = PrefixClient(prefix.address, owner="loader"), Tally()
    try:
        for i in range(DISTINCT_PROMPTS):
            tally.run(lambda i=i: loader.generate(prompt(i), config=GenConfig(max_new_tokens=1)).collect())
            if enough(tallies, tally):
                break
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    return tallies, tally


def test_live_clients_never_starve_while_200_prompts_fill_the_cache(services) -> None:
    engine, prefix = services(quotas=True, engine_share=0.5, pressure_retry=True)
    tallies, loader = load(engine, prefix)
    for name, tally in tallies.items():
        assert tally.calls >= 5, (name, tally)
        assert not tally.errors, (name, tally)
    assert not loader.errors and loader.calls == DISTINCT_PROMPTS
    stats = PrefixClient(prefix.address).stats()
    # the budget: half the engine's 12 sessions and of its 12 x 256 positions, full but within it
    assert (stats.max_entries, stats.max_positions, stats.engine_share) == (6, 6 * MAX_SESSION_TOKENS, 0.5)
    # full: an answer's entry that covers its prompt's replaces it (one fewer) when it lands last
    assert 5 <= stats.entries <= 6 and 0 < stats.positions <= stats.max_positions
    per = engine.deps.limits.kv_bytes_per_position  # Stats reports the budget in the engine's bytes too
    assert per > 0 and (stats.bytes_held, stats.max_bytes) == (
        stats.positions * per,
        stats.max_positions * per,
    )
    assert stats.inserts >= DISTINCT_PROMPTS and stats.hits >= tallies["gateway"].calls - 1
    registry = engine.deps.registry
    assert registry.count("prefix-service") == 6 and prefix.server.deps.backend.sessions.held() == 6
    assert registry.usage("prefix-service").quota.max_sessions == 6  # the engine's persistent budget


def test_negative_control_the_whole_engine_and_no_retry_starves_them(services) -> None:
    # The behaviour before the budget: the service may hold as many snapshots as the engine has
    # sessions, nothing evicts for a live request, the engine has no quotas.
    engine, prefix = services(quotas=False, engine_share=1.0, pressure_retry=False)

    def starving(tallies: dict[str, Tally], loader: Tally) -> bool:
        return all(tally.errors["RESOURCE_EXHAUSTED"] for tally in [*tallies.values(), loader])

    tallies, loader = load(engine, prefix, starving)
    # every live client is refused: on the engine, and on the gateway for a cached prompt
    assert starving(tallies, loader), (tallies, loader)
    assert PrefixClient(prefix.address).stats().max_entries == MAX_SESSIONS


def test_a_cached_prompt_on_a_full_engine_evicts_and_succeeds(services) -> None:
    # Another owner fills what the service leaves: the gateway's next request (a cached prompt)
    # meets a full engine, evicts one entry by the policy and retries; without the retry it fails.
    for retry in (True, False):
        engine, prefix = services(quotas=False, engine_share=0.5, pressure_retry=retry)
        client = PrefixClient(prefix.address, owner="alice")
        for i in range(6):
            client.generate(prompt(i), config=GenConfig(max_new_tokens=1)).collect()
        hog = EngineClient(engine.address, owner="hog")
        held = [
            hog.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
            .collect()
            .started.session
            for _ in range(MAX_SESSIONS - 6)
        ]
        assert engine.runner.resident_sessions == MAX_SESSIONS
        if retry:
            out = client.generate(prompt(5), config=GenConfig(max_new_tokens=1)).collect()
            assert out.done is not None
            stats = client.stats()
            assert (stats.pressure_evictions, stats.pressure_retries) == (1, 1) and stats.entries == 5
        else:
            with pytest.raises(ResourceExhausted):
                client.generate(prompt(5), config=GenConfig(max_new_tokens=1)).collect()
        for session in held:
            hog.close(session)
