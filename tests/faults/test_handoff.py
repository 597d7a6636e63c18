"""Prefill/decode hand-off with real processes (``forkline-engine --role``, ``fleet/handoff.py``): a
tiny engine that prefills only and one that decodes only behind a prefix service. A generation's first
token comes from the prefill engine, the rest from the decode engine (``Done.engine``), and the whole
stream equals a colocated run on one engine (its own Generate, no prefix service), greedy and seeded;
the prompt's snapshot moved between them (or was recomputed where the rates say that is cheaper:
either way the output is the same). With the decode engine killed, the hand-off continues on the
prefill engine (a failed hand-off recomputes locally)."""

from __future__ import annotations

import grpc
import pytest

from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.serving.engine_wire.config import generation_config
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc
from tests.service.helpers import wait_for
from tests.service.test_engine_restart import ServiceProcess
from tests.service.test_routing_moves import OWNER, TinyEngine, engine_stats

PROMPT = [ord(c) for c in "Prefill here, decode there, and the same answer either way. "]
NEW_TOKENS = 40
PATIENCE_S = 120.0


@pytest.fixture
def split():
    """(prefill engine, decode engine, a client of a prefix service over both)."""
    prefill, decode = (
        TinyEngine("--role", "prefill", step_s=0.01),
        TinyEngine("--role", "decode", step_s=0.01),
    )
    prefix = ServiceProcess(
        "prefix_service", "--engine", prefill.address, "--engine", decode.address, "--port", "0"
    )
    client = PrefixClient(prefix.listening(), owner="split", timeout=PATIENCE_S)
    assert wait_for(lambda: sum(s.routable for s in engine_stats(client).values()) == 2, PATIENCE_S)
    yield prefill, decode, client
    for process in (prefix, prefill, decode):
        process.kill()


def colocated(address: str, config: GenConfig) -> list[int]:
    """The whole generation on one engine, through its own Generate: the reference."""
    with grpc.insecure_channel(address) as channel:
        request = epb.GenerateRequest(tokens=epb.TokenIds(ids=PROMPT), config=generation_config(config, True))
        events = engine_pb2_grpc.EngineStub(channel).Generate(request, metadata=OWNER, timeout=60)
        return [t for event in events if event.HasField("tokens") for t in event.tokens.ids]


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_a_split_generation_equals_a_colocated_one(split, temperature) -> None:
    prefill, decode, client = split
    config = GenConfig(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=9)
    reference = colocated(prefill.address, config)
    result = client.generate(PROMPT, config=config, ignore_eos=True, namespace=f"t{temperature}").collect()
    assert list(result.tokens) == reference and len(reference) == NEW_TOKENS
    assert result.done.engine == decode.address and result.done.resumes == 0
    assert result.done.generated_tokens == NEW_TOKENS and result.done.prompt_positions == len(PROMPT)
    stats = engine_stats(client)
    assert stats[prefill.address].routed >= 1 and stats[decode.address].routed >= 1
    assert stats[decode.address].moves_in + sum(stats[decode.address].move_refusals.values()) >= 1


def test_without_its_decode_engine_a_hand_off_continues_on_the_prefill_side(split) -> None:
    prefill, decode, client = split
    config = GenConfig(max_new_tokens=NEW_TOKENS, temperature=0.0)
    reference = colocated(prefill.address, config)
    decode.kill()
    result = client.generate(PROMPT, config=config, ignore_eos=True, namespace="alone").collect()
    assert list(result.tokens) == reference and result.done.engine == prefill.address
