"""The issue's four-tenant case with real processes: two engine processes (the packaged SmolLM2), one
prefix-service process in front of them, four tenants with distinct long system prompts that begin
alike (as a company's assistants do; the chat template adds its own header), three chat requests
each, one at a time. ``--routing cost`` spreads the tenants' entries over both engines and every
repeat still reuses its whole prompt; ``--routing cache_aware`` (the negative control) piles every
tenant on the first engine: the shared beginning makes it the best match for every later miss."""

from __future__ import annotations

import pytest

from clients.prefix_client import PrefixClient
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


class EngineProcess(ServiceProcess):
    def __init__(self) -> None:
        self.port = free_port()
        super().__init__(
            "engine_service", "--port", str(self.port), "--max_sessions", "16", "--max_session_tokens", "256"
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def engines():
    started = [EngineProcess(), EngineProcess()]
    try:
        for engine in started:
            wait_serving(engine)
        yield started
    finally:
        for engine in started:
            engine.kill()


def four_tenants(engines, routing: str) -> tuple[list[str], list[list[int]], dict[str, int]]:
    """Each tenant's engine per request, its reused positions per request, and entries per engine."""
    addresses = [a for e in engines for a in ("--engine", e.address)]
    prefix = ServiceProcess("prefix_service", *addresses, "--routing", routing, "--port", "0")
    try:
        client = PrefixClient(prefix.listening(), owner="tenants", timeout=60.0)
        served, reused = [], []
        for system in TENANTS:
            rounds = [
                client.generate(
                    text=QUESTION, chat=True, system=PREAMBLE + system, max_new_tokens=2
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
    assert sorted(set(served)) == sorted([first, second])  # each tenant stays on one engine...
    assert served.count(first) == 2 and served.count(second) == 2  # ...two tenants each
    assert all(n > 0 for n in entries.values()) and len(entries) == 2


@pytest.mark.slow
def test_negative_control_cache_aware_piles_every_tenant_on_one_engine(engines) -> None:
    served, _, entries = four_tenants(engines, "cache_aware")
    assert len(set(served)) == 1
    assert sorted(entries.values())[0] == 0  # the other engine holds nothing
