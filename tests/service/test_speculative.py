"""``forkline-engine --speculative lookup`` over gRPC, against a plain engine of the same model: greedy
and seeded generations give the same tokens (drafts verified, some accepted), Info reports the mode
and the draft counts, and the snapshots a speculative generation stores -- its prompt's and its final
one -- continue exactly like a cold run on the plain engine (a stored snapshot is never taken at a
position written only by a draft). Negative control: another seed gives another text."""

from __future__ import annotations

import grpc
import pytest

from clients.engine_client import EngineClient
from engine_service.api.config import GenConfig
from protos import engine_pb2 as pb

# a prompt that repeats itself, so the session's own history drafts
PROMPT = [ord(c) for c in "abcabcabcabcab"]


@pytest.fixture
def engines(engine_factory):
    plain = EngineClient(engine_factory().address, owner="t")
    spec = EngineClient(engine_factory(speculative="lookup").address, owner="t")
    yield plain, spec
    plain.close_channel()
    spec.close_channel()


@pytest.mark.parametrize("temperature", [0.0, 3.0])  # 3.0: the tiny model varies
def test_speculative_generation_equals_plain(engines, temperature) -> None:
    plain, spec = engines
    config = GenConfig(max_new_tokens=60, temperature=temperature, seed=5)
    want = plain.generate(PROMPT, config=config, ignore_eos=True).collect().tokens
    got = spec.generate(PROMPT, config=config, ignore_eos=True).collect().tokens
    assert got == want
    info = spec.info()
    assert (info.speculative, info.num_drafts) == ("lookup", 4)
    assert 0 < info.accepted_draft_tokens <= info.draft_tokens
    assert plain.info().speculative == "off" and plain.info().draft_tokens == 0
    if temperature:
        other = GenConfig(max_new_tokens=60, temperature=temperature, seed=6)
        assert plain.generate(PROMPT, config=other, ignore_eos=True).collect().tokens != want


def test_snapshots_of_a_speculative_generation_continue_like_a_cold_run(engines) -> None:
    plain, spec = engines
    config = GenConfig(max_new_tokens=40, temperature=0.0)
    out = spec.generate(PROMPT, config=config, ignore_eos=True, prompt_snapshot=True, final_snapshot=True)
    result = out.collect()
    assert spec.info().draft_tokens > 0
    more = GenConfig(max_new_tokens=12, temperature=0.0)
    for snapshot in result.snapshots:
        assert snapshot.handle, snapshot
        fed = [*PROMPT, *result.tokens][: snapshot.position + 1]  # what it holds, then the next id
        continued = spec.generate(fed[-1:], config=more, session=snapshot.handle, ignore_eos=True)
        cold = plain.generate(fed, config=more, ignore_eos=True).collect().tokens
        assert continued.collect().tokens == cold, snapshot.kind
    assert {s.position for s in result.snapshots} == {len(PROMPT), len(PROMPT) + len(result.tokens) - 1}


def test_a_request_turns_speculation_off_and_a_bad_mode_is_refused(engines) -> None:
    from engine_service.api.errors import InvalidArgument

    plain, spec = engines
    config = GenConfig(max_new_tokens=40, temperature=0.0, speculative="off")
    before = spec.info().draft_tokens
    got = spec.generate(PROMPT, config=config, ignore_eos=True).collect().tokens
    assert spec.info().draft_tokens == before  # no drafts for it
    assert got == plain.generate(PROMPT, config=config, ignore_eos=True).collect().tokens
    on = GenConfig(max_new_tokens=40, temperature=0.0)
    spec.generate(PROMPT, config=on, ignore_eos=True).collect()
    assert spec.info().draft_tokens > before  # the control: the same request drafts by default
    with pytest.raises(InvalidArgument, match="speculative"):
        GenConfig(speculative="sometimes")
    message = pb.GenerateRequest(
        tokens=pb.TokenIds(ids=PROMPT), config=pb.GenerationConfig(max_new_tokens=2, speculative="sometimes")
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(spec.stub.Generate(message, metadata=(("forkline-owner", "t"),), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculative" in caught.value.details()


def test_the_engine_metrics_count_drafts_by_result(engine_factory) -> None:
    from tests.service.test_metrics import Scrape

    engine = engine_factory(speculative="lookup", metrics=True)
    port = engine.server.start_metrics("127.0.0.1", 0)
    client = EngineClient(engine.address, owner="t")
    client.generate(PROMPT, config=GenConfig(max_new_tokens=40), ignore_eos=True).collect()
    info, scrape = client.info(), Scrape(port)
    client.close_channel()
    name = "forkline_engine_draft_tokens_total"
    assert scrape.value(name, source="lookup", result="accepted") == info.accepted_draft_tokens > 0
    rejected = info.draft_tokens - info.accepted_draft_tokens
    assert scrape.value(name, source="lookup", result="rejected") == rejected
    assert 1 <= scrape.value("forkline_engine_draft_cost_ratio") <= 16


def test_suffix_drafts_only_from_the_callers_own_earlier_requests(engine_factory) -> None:
    """``--speculative suffix`` over gRPC: the owner's second identical request drafts its first answer
    (source ``suffix`` accepted), another owner's does not; every answer equals a plain engine's."""
    from tests.service.test_metrics import Scrape

    engine = engine_factory(speculative="suffix", metrics=True)
    port = engine.server.start_metrics("127.0.0.1", 0)
    plain = EngineClient(engine_factory().address, owner="t")
    prompt = list(range(40, 70))  # no repeated n-gram: the first drafts can only come from elsewhere
    config = GenConfig(max_new_tokens=30)
    want = plain.generate(prompt, config=config, ignore_eos=True).collect().tokens

    def ask(owner: str) -> float:
        client = EngineClient(engine.address, owner=owner)
        assert client.generate(prompt, config=config, ignore_eos=True).collect().tokens == want
        assert client.info().speculative == "suffix"
        client.close_channel()
        return Scrape(port).value("forkline_engine_draft_tokens_total", source="suffix", result="accepted")

    assert ask("alice") == 0
    alice = ask("alice")
    assert alice > 0 and ask("bob") == alice
    plain.close_channel()


@pytest.mark.parametrize("temperature", [0.0, 3.0])
def test_drafts_under_a_json_schema_with_logprobs_equal_plain(engines, temperature) -> None:
    """A grammar masks each verification row as plain decoding masks that draw (the drafts it does not
    allow are cut first), and the accepted tokens' log probabilities are reported: the same JSON, tokens
    and log probabilities as the plain engine."""
    import json

    plain, spec = engines
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    config = GenConfig(
        max_new_tokens=200, temperature=temperature, seed=3, top_logprobs=2, json_schema=json.dumps(schema)
    )
    prompt = list(b"Some JSON: ")
    want = plain.generate(prompt, config=config).collect()
    before = spec.info().draft_tokens
    got = spec.generate(prompt, config=config).collect()
    assert got.tokens == want.tokens and got.text == want.text
    json.loads(got.text)
    assert [e.chosen.id for e in got.logprobs] == [e.chosen.id for e in want.logprobs] == got.tokens
    assert (
        max(
            abs(a.chosen.logprob - b.chosen.logprob) for a, b in zip(got.logprobs, want.logprobs, strict=True)
        )
        < 1e-2
    )
    assert spec.info().draft_tokens > before  # drafts were verified under the grammar
