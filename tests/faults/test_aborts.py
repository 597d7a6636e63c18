"""Random aborts leak nothing, with real processes (a tiny engine and a prefix service): 1,000 gateway
generations over prompts that share prefixes (hits, clones, stores, joins), each cancelled by its
client at a random point -- before its first event, mid-prefill, mid-decode, or by a deadline that
runs out -- then the engine is asked what it holds. Every session it holds is a stored entry of the
prefix service (resident sessions = open handles = entries), the client owns nothing, and a last
uncancelled generation equals a cold run (the cache served exactly after all that). Deadlines of a
few milliseconds on an overloaded machine still leave a few handles charged to the client that no
call can name (3 of 1,000 aborts with two CPU burners beside the test, none of 400 without them;
2 of 400 before the engine Generate outlived the caller's deadline, ``RemoteStream``, so the snapshot
events it sent are read; 7 of 1,000 before the lookup's clone and the failed start's close ran without
it): the engine's idle expiry (``--idle_session_timeout``, 2 s here, 300 s by default) is what
reclaims them, and the test waits for it."""

from __future__ import annotations

import random

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError
from tests.service.helpers import wait_for
from tests.service.test_engine_restart import ServiceProcess
from tests.service.test_routing_moves import TinyEngine

ABORTS = 1000
PATIENCE_S = 120.0
HEADS = [[ord(c) for c in f"Shared head number {i}: " * 3] for i in range(4)]


def aborted_runs(address: str, aborts: int, seed: int) -> dict[str, int]:
    """``aborts`` generations each cancelled at a random point; how many ended which way."""
    rng = random.Random(seed)
    client = PrefixClient(address, owner="aborter", timeout=PATIENCE_S)
    ended = {"cancelled": 0, "deadline": 0, "completed": 0}
    try:
        for _ in range(aborts):
            prompt = rng.choice(HEADS) + [rng.randrange(65, 91) for _ in range(rng.randrange(1, 12))]
            config = GenConfig(
                max_new_tokens=rng.randrange(1, 24), temperature=rng.choice([0.0, 1.0]), seed=1
            )
            timeout = rng.choice([None, None, None, 0.005, 0.02])
            stream = client.generate(prompt, config=config, ignore_eos=True, timeout=timeout)
            stop_after = rng.randrange(0, 6)
            try:
                for k, _event in enumerate(stream):
                    if k >= stop_after:
                        stream.cancel()
                        ended["cancelled"] += 1
                        break
                else:
                    ended["completed"] += 1
            except ForklineError:  # the deadline ran out (or the cancel raced the end)
                ended["deadline"] += 1
    finally:
        client.close_channel()
    return ended


def holdings(engine: str, prefix: str) -> tuple[int, int, int, int]:
    """(resident sessions, open handles, the client's sessions, the prefix service's entries)."""
    client = EngineClient(engine, owner="aborter")
    try:
        info = client.info()
    finally:
        client.close_channel()
    prefix_client = PrefixClient(prefix, owner="aborter", timeout=30)
    try:
        entries = prefix_client.stats().entries
    finally:
        prefix_client.close_channel()
    return info.resident_sessions, info.open_handles, info.caller.sessions, entries


def test_random_aborts_leave_only_the_cache_behind() -> None:
    engine = TinyEngine("--idle_session_timeout", "2", step_s=0.002)
    prefix = ServiceProcess("prefix_service", "--engine", engine.address, "--port", "0")
    try:
        address = prefix.listening()
        ended = aborted_runs(address, ABORTS, seed=4)
        assert ended["cancelled"] > ABORTS // 2 and ended["deadline"] > 0  # the campaign aborted
        seen: list[tuple[int, int, int, int]] = []

        def settled() -> bool:
            seen.append(holdings(engine.address, address))
            resident, handles, mine, entries = seen[-1]
            return mine == 0 and resident == handles == entries

        assert wait_for(settled, PATIENCE_S), seen[-3:]
        assert seen[-1][3] > 0  # the cache kept entries (the check is not vacuous)
        client = PrefixClient(address, owner="aborter", timeout=PATIENCE_S)
        prompt = HEADS[0] + [ord("Q")]
        config = GenConfig(max_new_tokens=16, temperature=0.0)
        served = client.generate(prompt, config=config, ignore_eos=True).collect()
        client.close_channel()
        cold = EngineClient(engine.address, owner="cold")
        reference = cold.generate(prompt, config=config, ignore_eos=True).collect()
        cold.close_channel()
        assert served.tokens == reference.tokens and served.done.reused_positions > 0
    finally:
        prefix.kill()
        engine.kill()
