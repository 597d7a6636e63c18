"""The issue's four-tenant case with real processes: two engine processes (the packaged SmolLM2), one
prefix-service process in front of them, four tenants with distinct long system prompts that begin
alike (as a company's assistants do; the chat template adds its own header), three chat requests
each, one at a time. ``--routing cost`` spreads the tenants' entries over both engines and every
repeat still reuses its whole prompt; ``--routing cache_aware`` (the negative control) piles every
tenant on the first engine: the shared beginning makes it the best match for every later miss.
The same on engine processes of the tests' tiny model (one token per character), where the tenants
share one system message and differ in the user's: seconds, so not marked slow."""

from __future__ import annotations

import pytest

from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from protos import prefix_pb2
from tests.service.test_engine_restart import ServiceProcess, free_port, wait_serving

PREAMBLE = "You are an assistant of the Example Company. Answer briefly, politely and in English. "
TENANTS = [  # 131-145 positions each with the template; the shared beginning is about 25
    "You help gardeners: soil, watering, pruning and pests of roses, tomatoes and apple trees, "
    "season by season, for small gardens in a temperate climate with cold winters. You know compost, "
    "mulch, raised beds, crop rotation, companion planting, seed saving and how to overwinter tender "
    "plants in pots. You suggest organic remedies first, explain when to sow, transplant and harvest, "
    "and you warn about frost dates, slugs, aphids, blight and powdery mildew before they strike.",
    "You help cyclists: tyre pressure, chain wear, brake pads and gear tuning of city, road and "
    "mountain bikes, and how to plan a safe commute through heavy traffic. You know tubeless setups, "
    "wheel truing, cable routing, hydraulic brake bleeding, saddle height and bike fitting. You explain "
    "how to carry loads with racks and panniers, how to ride in rain, snow and darkness with good lights, "
    "and you recommend tools for a small home workshop and a kit for roadside repairs.",
    "You help bakers: sourdough starters, hydration, proofing times, oven temperatures and "
    "scoring of breads, plus the chemistry of yeast, salt and gluten. You know laminated doughs, "
    "croissants, brioche, rye breads, enriched doughs and gluten free flours. You explain how to read a "
    "crumb, how to fix dense loaves, flat loaves and burnt bottoms, how to bake with steam in a home oven, "
    "and how to plan a bake around a working day with retarded proofing in the fridge.",
    "You help sailors: knots, tides, reefing the main, reading the weather and the rules of way "
    "for small keelboats on lakes and along sheltered coasts. You know anchoring, mooring, man overboard "
    "drills, trimming sails for every point of sail, heaving to and docking under engine in a crosswind. "
    "You explain charts, buoys, lights and sound signals, safety gear and radio calls, and how to plan "
    "a passage around tidal gates and forecasts of wind and swell.",
]
QUESTION = "Give me one tip."
# the tiny model's engines hold 256 characters a session: prompts of ~190 that share one system
# message (38 characters; its end is a checkpoint: the tiny model's sliding-window layers cannot
# rewind a longer snapshot to a shorter shared prefix)
TINY_PREAMBLE = "Be brief."
TINY_TENANTS = [
    "You help gardeners with soil, watering, pruning and pests of roses and apple trees.",
    "You help cyclists with tyres, chains, brake pads and gears of city and road bikes.",
    "You help bakers with sourdough starters, hydration, proofing and oven temperatures.",
    "You help sailors with knots, tides, reefing the main and reading the weather at sea.",
]


class EngineProcess(ServiceProcess):
    def __init__(self, module: str = "engine_service", *args: str) -> None:
        self.port = free_port()
        super().__init__(module, "--port", str(self.port), *args)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def engines():
    yield from running(
        [
            EngineProcess("engine_service", "--max_sessions", "16", "--max_session_tokens", "256")
            for _ in range(2)
        ]
    )


@pytest.fixture(scope="module")
def tiny_engines():
    yield from running([EngineProcess("tests.service.tiny_engine") for _ in range(2)])


def running(started: list[EngineProcess]):
    try:
        for engine in started:
            wait_serving(engine)
        yield started
    finally:
        for engine in started:
            engine.kill()


def system_prompts(tenant: str) -> tuple[str, str]:
    """A tenant's own system prompt after the shared preamble; the same question."""
    return PREAMBLE + tenant, QUESTION


def four_tenants(
    engines, routing: str, tenants: list[str] = TENANTS, layout=system_prompts, *flags: str
) -> tuple[list[str], list[list[int]], dict[str, int]]:
    """Each tenant's engine, its reused positions per request, and entries per engine."""
    addresses = [a for e in engines for a in ("--engine", e.address)]
    prefix = ServiceProcess("prefix_service", *addresses, "--routing", routing, "--port", "0", *flags)
    try:
        client = PrefixClient(prefix.listening(), owner="tenants", timeout=60.0)
        served, reused = [], []
        for system in tenants:
            rounds = [
                client.generate(
                    text=layout(system)[1],
                    chat=True,
                    system=layout(system)[0],
                    config=GenConfig(max_new_tokens=2),
                ).collect()
                for _ in range(3)
            ]
            served.append({r.done.engine for r in rounds})
            reused.append([r.done.reused_positions for r in rounds])
            prompt = rounds[0].done.reused_positions + rounds[0].done.prompt_positions
            assert all(r.done.reused_positions == prompt - 1 for r in rounds[1:]), (
                routing,
                reused[-1],
                prompt,
            )
        stats = client.stub.Stats(prefix_pb2.StatsRequest())
        entries = {e.engine: e.entries for e in stats.engines}
        client.channel.close()
        return [next(iter(s)) if len(s) == 1 else "split" for s in served], reused, entries
    finally:
        prefix.kill()


@pytest.mark.slow
def test_four_tenants_spread_over_both_engines_and_every_repeat_hits(engines) -> None:
    served, _, entries = four_tenants(engines, "cost")
    first, second = (e.address for e in engines)
    # each tenant stays on one engine, and both engines serve tenants (how many each is the learned
    # rates' call: 2 / 2 on a quiet machine, 3 / 1 seen on a loaded one)
    assert sorted(set(served)) == sorted([first, second])
    assert all(n > 0 for n in entries.values()) and len(entries) == 2


@pytest.mark.slow
def test_negative_control_cache_aware_piles_every_tenant_on_one_engine(engines) -> None:
    served, _, entries = four_tenants(engines, "cache_aware")
    assert len(set(served)) == 1
    assert sorted(entries.values())[0] == 0  # the other engine holds nothing


def tiny_layout(tenant: str) -> tuple[str, str]:
    """One shared system message; the tenant's instructions and the question as the user's."""
    return TINY_PREAMBLE, f"{tenant} {QUESTION}"


# the tiny engine's persistent owner; its 8 sessions give the service 4 entries, which four tenants'
# answers would fill (then cache-aware spills): prompts only, as the test is about prompt placement
TINY = (TINY_TENANTS, tiny_layout, "--owner", "prefix-service", "--no-cache_generated")


def test_tiny_four_tenants_spread_over_both_engines_and_every_repeat_hits(tiny_engines) -> None:
    served, _, entries = four_tenants(tiny_engines, "cost", *TINY)
    assert sorted(set(served)) == sorted(e.address for e in tiny_engines)  # both serve (2 / 2 when quiet)
    assert all(n > 0 for n in entries.values()) and len(entries) == 2


def test_tiny_negative_control_cache_aware_piles_every_tenant_on_one_engine(tiny_engines) -> None:
    served, _, entries = four_tenants(tiny_engines, "cache_aware", *TINY)
    assert len(set(served)) == 1 and sorted(entries.values())[0] == 0
