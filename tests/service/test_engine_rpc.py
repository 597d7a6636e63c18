"""Engine service over real sockets: every RPC, streaming order, equality with in-process runs."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients.engine_client import Done, EngineClient, Snapshot, Started, Tokens
from engine_service.api import errors
from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.api.errors import NotFound
from protos import engine_pb2 as epb
from tests.service.helpers import PROMPT, in_process_tokens, sampled, send_as_is, wait_for


def test_generate_matches_in_process_and_streams_in_order(engine) -> None:
    client = EngineClient(engine.address, owner="alice")
    out = client.generate(PROMPT, prompt_snapshot=True, **sampled(12)).collect()
    kinds = [type(e) for e in out.events]
    assert kinds[0] is Started and kinds[-1] is Done
    # the prompt snapshot streams after the first token (which never waits for its clone), before the rest
    assert kinds.index(Tokens) < kinds.index(Snapshot) < len(kinds) - 2 and kinds[-2] is Tokens
    assert next(e for e in out.events if isinstance(e, Snapshot)).position == len(PROMPT)
    assert out.tokens == in_process_tokens(PROMPT, 12, temperature=10.0, seed=7)
    assert len(set(out.tokens)) > 1  # sampled: a stuck model would make the comparison vacuous
    assert out.text == client.detokenize(out.tokens)
    assert out.started.position == 0 and out.started.input_positions == len(PROMPT)
    d = out.done
    assert (d.finish_reason, d.prompt_positions, d.reused_positions, d.generated_tokens) == (
        "length",
        len(PROMPT),
        0,
        12,
    )
    assert d.position == len(PROMPT) + 11  # the last token is pending, not committed
    (snap,) = out.snapshots
    assert snap.kind == "prompt" and snap.position == len(PROMPT) and snap.handle
    assert client.describe(snap.handle) == (len(PROMPT), False)


def test_continuing_from_a_snapshot_equals_a_cold_run(engine) -> None:
    client = EngineClient(engine.address, owner="alice")
    snap = (
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1), prompt_snapshot=True)
        .collect()
        .snapshots[0]
        .handle
    )
    suffix = [ord(c) for c in "and runs"]
    warm = client.generate(suffix, session=snap, **sampled(10)).collect()
    assert warm.started.position == len(PROMPT) and warm.done.reused_positions == len(PROMPT)
    assert warm.tokens == in_process_tokens(PROMPT + suffix, 10, temperature=10.0, seed=7)
    # negative control: a different prefix gives different tokens
    assert warm.tokens != in_process_tokens(PROMPT[1:] + suffix, 10, temperature=10.0, seed=7)


def test_the_final_snapshot_holds_the_prompt_and_the_answer_but_its_pending_token(engine) -> None:
    client = EngineClient(engine.address, owner="alice")
    out = client.generate(PROMPT, prompt_snapshot=True, final_snapshot=True, **sampled(8)).collect()
    kinds = [type(e) for e in out.events]
    prompt, final = out.snapshots
    assert (prompt.kind, final.kind) == ("prompt", "generated") and kinds[-2:] == [Snapshot, Done]
    assert final.position == out.done.position == len(PROMPT) + 8 - 1
    assert final.content_digest == content_digest(PROMPT + out.tokens[:-1])  # what the gateway keys
    assert client.describe(final.handle) == (final.position, False)
    # it continues like a cold run over those ids
    follow = client.generate([ord("?")], session=final.handle, **sampled(6)).collect()
    assert follow.tokens == in_process_tokens(
        PROMPT + out.tokens[:-1] + [ord("?")], 6, temperature=10.0, seed=7
    )


def test_breakpoint_snapshots(engine) -> None:
    client = EngineClient(engine.address, owner="alice")
    out = client.generate(
        PROMPT, config=GenConfig(max_new_tokens=2, prefill_breakpoints=(10, 40)), prompt_snapshot=True
    ).collect()
    assert [(s.kind, s.position) for s in out.snapshots] == [
        ("breakpoint", 10),
        ("breakpoint", 40),
        ("prompt", len(PROMPT)),
    ]
    for s in out.snapshots:
        assert client.describe(s.handle)[0] == s.position


def test_clone_close_describe_release_owner(engine) -> None:
    alice = EngineClient(engine.address, owner="alice")
    bob = EngineClient(engine.address, owner="bob")
    base = alice.info().resident_sessions
    out = alice.generate(PROMPT, config=GenConfig(max_new_tokens=3), keep_session=True).collect()
    session = out.started.session
    assert alice.describe(session) == (len(PROMPT) + 2, False)
    # ring layers (window 4, 64 rows written per forward) keep positions >= 92 - 64 = 28
    assert alice.clone(session, 20) is None
    child = alice.clone(session, 50)
    assert alice.describe(child) == (50, False)
    refused = alice.clone_detailed(session, 10_000)
    assert not refused.session and "outside" in refused.refusal
    with pytest.raises(errors.InvalidArgument, match="new_owner 'bob'"):  # client to client: refused
        alice.clone(session, 60, new_owner="bob")
    gift = alice.clone(session, 60, new_owner="prefix-service")  # to a persistent owner (the prefix service)
    keeper = EngineClient(engine.address, owner="prefix-service")
    assert keeper.describe(gift) == (60, False)
    assert engine.deps.registry.payer_of(gift) == "alice"  # alice's quota until the keeper claims it
    keeper.claim(gift)
    assert engine.deps.registry.payer_of(gift) == "prefix-service"
    gift = keeper.clone(gift, 60, new_owner="bob")  # and a persistent owner to a client (a lookup)
    assert bob.describe(gift) == (60, False)
    with pytest.raises(NotFound):
        alice.describe(gift)
    assert alice.info().resident_sessions == base + 4
    alice.close(child)
    with pytest.raises(NotFound):
        alice.close(child)
    assert alice.release_owner() == 1  # the kept session
    assert bob.release_owner() == 1
    assert keeper.release_owner() == 1
    assert wait_for(lambda: alice.info().resident_sessions == base)


def test_keep_session_continues_with_pending_token(engine) -> None:
    client = EngineClient(engine.address, owner="alice")
    first = client.generate(PROMPT, keep_session=True, **sampled(4)).collect()
    more = client.generate([ord("!")], session=first.started.session, **sampled(3)).collect()
    # the pending token of the first generation is fed first, then "!"
    assert more.started.position == len(PROMPT) + 3 and more.started.input_positions == 2
    expected = in_process_tokens(PROMPT + first.tokens + [ord("!")], 3, temperature=10.0, seed=7)
    assert more.tokens == expected


@pytest.mark.parametrize("ending", ["done", "cancelled"])
def test_close_session_closes_the_given_session_when_the_call_ends(engine_factory, ending) -> None:
    """close_session: the session handed to the call is closed as it ends, however it ends (the
    prefix service's lookup clone needs no Close after its Generate); without it the session stays."""
    engine = engine_factory(max_session_tokens=4096)
    client = EngineClient(engine.address, owner="alice")
    base = client.info().resident_sessions
    kept = (
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    control = client.clone(kept, len(PROMPT))
    client.generate([ord("!")], session=control, config=GenConfig(max_new_tokens=2)).collect()
    assert client.describe(control)[0] > len(PROMPT)  # without close_session: still there
    given = client.clone(kept, len(PROMPT))
    stream = client.generate(
        [ord("!")], session=given, close_session=True, config=GenConfig(max_new_tokens=2000), ignore_eos=True
    )
    if ending == "done":
        stream.collect()
    else:
        events = iter(stream)
        next(events), next(events)  # started, first tokens: the generation runs
        stream.cancel()
    assert wait_for(lambda: client.info().open_handles == 2)  # kept and control
    with pytest.raises(NotFound):
        client.describe(given)
    for session in (kept, control):
        client.close(session)
    assert wait_for(lambda: client.info().resident_sessions == base)


def test_a_refused_close_session_call_leaves_the_session(engine) -> None:
    client = EngineClient(engine.address, owner="alice")
    kept = (
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    zero = epb.GenerationConfig(max_new_tokens=0)
    request = epb.GenerateRequest(
        tokens=epb.TokenIds(ids=[ord("!")]), session=kept, close_session=True, config=zero
    )
    with pytest.raises(errors.InvalidArgument, match="max_new_tokens"):
        send_as_is(client, request)
    assert client.describe(kept)[0] == len(PROMPT)
    with pytest.raises(errors.InvalidArgument, match="close_session only applies to a given session"):
        client.generate(PROMPT, close_session=True, config=GenConfig(max_new_tokens=1)).collect()


def test_info_tokenize_detokenize_health_reflection(engine) -> None:
    client = EngineClient(engine.address, owner="alice")
    info = client.info()
    assert info.model.startswith("tiny") and info.cache_kind == "batched-sequence"
    assert len(info.instance_id) == 16 and info.fingerprint == engine.runner.fingerprint
    assert (info.max_sessions, info.max_session_tokens, info.vocab_size) == (8, 256, 128)
    assert info.eos_token_ids == (2,)
    assert client.tokenize("Hi!") == [72, 105, 33]
    assert client.tokenize("Hi", add_special_tokens=True) == [1, 72, 105]
    chat = client.tokenize("Hi", chat=True, system="Be brief")
    assert (
        client.detokenize(chat)
        == "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert client.detokenize([72, 105]) == "Hi"
    text_run = client.generate(text="Hi", chat=True, config=GenConfig(max_new_tokens=2)).collect()
    assert text_run.started.input_positions == len(client.tokenize("Hi", chat=True)) < len(chat)
    assert client.health() == "SERVING" and client.health("forkline.engine.v1.Engine") == "SERVING"
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    replies = list(
        stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"forkline.engine.v1.Engine", "grpc.health.v1.Health"} <= names


def test_cancelled_stream_frees_its_session(engine_factory) -> None:
    engine = engine_factory(max_session_tokens=4096)
    client = EngineClient(engine.address, owner="alice")
    base = client.info().resident_sessions
    stream = client.generate(PROMPT, config=GenConfig(max_new_tokens=4000), ignore_eos=True)
    events = iter(stream)
    started = next(events)
    assert isinstance(started, Started)
    next(events)  # first tokens: the generation is running
    assert client.info().resident_sessions == base + 1
    stream.cancel()
    assert wait_for(lambda: client.info().resident_sessions == base and client.info().open_handles == 0)
    with pytest.raises(NotFound):
        client.describe(started.session)
    # the engine keeps serving
    assert client.generate(PROMPT, config=GenConfig(max_new_tokens=2)).collect().done.generated_tokens == 2


def test_idle_client_sessions_expire(engine_factory) -> None:
    engine = engine_factory(idle_timeout_s=0.3)
    client = EngineClient(engine.address, owner="alice")
    keeper = EngineClient(engine.address, owner="prefix-service")  # persistent owner: never expires
    base = client.info().resident_sessions
    handle = (
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    kept = (
        keeper.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    assert client.info().resident_sessions == base + 2
    assert wait_for(lambda: client.info().resident_sessions == base + 1, timeout=60)
    with pytest.raises(NotFound):
        client.describe(handle)
    assert keeper.describe(kept)[0] == len(PROMPT)


def test_health_stub_directly(engine) -> None:
    channel = grpc.insecure_channel(engine.address)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


def test_prepared_embeddings_input_equals_the_token_path(engine_factory) -> None:
    import mlx.core as mx
    import numpy as np

    from engine_service.model.random_init import random_model
    from protos import engine_pb2 as pb

    engine = engine_factory(prepared_inputs=True)
    client = EngineClient(engine.address, owner="alice")
    embeddings = np.array(random_model("FRFR", 4, 0).embed(mx.array(PROMPT, dtype=mx.int32)), dtype="<f4")
    prepared = pb.PreparedInput(kind="embeddings", payload=embeddings.tobytes(), shape=list(embeddings.shape))
    out = client.generate(prepared=prepared, **sampled(8)).collect()
    assert out.started.input_positions == len(PROMPT)
    assert out.tokens == in_process_tokens(PROMPT, 8, temperature=10.0, seed=7)


def test_snapshot_of_a_call_cancelled_before_it_is_streamed_is_released(engine_factory, monkeypatch) -> None:
    # The client cancels while the engine is still turning a prompt snapshot into a handle: the handle
    # was never streamed, so the caller cannot know it and the engine must not keep it (a persistent
    # owner such as the prefix service would otherwise hold it forever).
    import threading

    from engine_service.sessions.generation_call import GenerationCall

    entered, cancelled = threading.Event(), threading.Event()
    original = GenerationCall._register

    def slow_register(self, item):
        entered.set()
        cancelled.wait(10)  # the client has cancelled by now
        return original(self, item)

    monkeypatch.setattr(GenerationCall, "_register", slow_register)
    engine = engine_factory(max_session_tokens=4096)
    client = EngineClient(engine.address, owner="prefix-service")
    stream = client.generate(
        PROMPT, config=GenConfig(max_new_tokens=4000), ignore_eos=True, prompt_snapshot=True
    )
    events = iter(stream)
    assert isinstance(next(events), Started)
    assert entered.wait(10)
    stream.cancel()
    assert wait_for(
        lambda: engine.runner.metrics().generations_finished == 1
    )  # the cancel reached the engine
    cancelled.set()
    assert wait_for(lambda: engine.runner.resident_sessions == 0 and len(engine.deps.registry) == 0), (
        engine.runner.resident_sessions,
        len(engine.deps.registry),
    )


def _clone(client: EngineClient, session: str, upto: int, expected: bytes = b""):
    from protos import engine_pb2 as pb

    return client._unary(
        client.stub.Clone, pb.CloneRequest(session=session, upto=upto, expected_content_digest=expected)
    )


def _described_digest(client: EngineClient, session: str) -> bytes:
    from protos import engine_pb2 as pb

    return client._unary(client.stub.Describe, pb.DescribeRequest(session=session)).content_digest


def test_content_digests_on_snapshots_clones_and_describe(engine_factory) -> None:
    from engine_service.api.content import content_digest
    from protos import engine_pb2 as pb

    engine = engine_factory(layers="FFFF")  # full-history layers: every boundary can be cloned
    client = EngineClient(engine.address, owner="alice")
    out = client.generate(
        PROMPT, config=GenConfig(max_new_tokens=3), prompt_snapshot=True, keep_session=True
    ).collect()
    session, (snap,) = out.started.session, out.snapshots
    committed = PROMPT + out.tokens[:-1]  # the last token is pending, not content
    assert snap.content_digest == content_digest(PROMPT)
    assert _described_digest(client, session) == content_digest(committed)
    base = client.info().resident_sessions
    ok = _clone(client, session, len(PROMPT), content_digest(PROMPT))
    assert (
        ok.session
        and ok.reason == pb.CLONE_REFUSAL_UNSPECIFIED
        and ok.content_digest == content_digest(PROMPT)
    )
    plain = _clone(client, session, 10)
    assert plain.session and plain.content_digest == content_digest(PROMPT[:10])
    italy = [ord(c) for c in "What is the capital of Italy?"]
    wrong = _clone(client, session, len(italy), content_digest(italy))
    assert (
        not wrong.session
        and wrong.reason == pb.CLONE_REFUSAL_CONTENT_MISMATCH
        and "expected" in wrong.refusal
    )
    assert client.info().resident_sessions == base + 2  # the refusal made no session
    assert _described_digest(client, session) == content_digest(committed)  # nor changed the source


def test_a_session_holding_a_prepared_input_has_no_content_digest(engine_factory) -> None:
    import mlx.core as mx
    import numpy as np

    from engine_service.api.content import content_digest
    from engine_service.model.random_init import random_model
    from protos import engine_pb2 as pb

    engine = engine_factory(prepared_inputs=True, layers="FFFF")
    client = EngineClient(engine.address, owner="alice")
    embeddings = np.array(random_model("FFFF", 4, 0).embed(mx.array(PROMPT, dtype=mx.int32)), dtype="<f4")
    prepared = pb.PreparedInput(kind="embeddings", payload=embeddings.tobytes(), shape=list(embeddings.shape))
    out = client.generate(
        prepared=prepared, config=GenConfig(max_new_tokens=2), prompt_snapshot=True, keep_session=True
    ).collect()
    (snap,) = out.snapshots
    assert snap.handle and snap.content_digest is None
    assert _described_digest(client, out.started.session) == b""
    # same values as the token prompt, but a prepared input never matches a token digest
    refused = _clone(client, out.started.session, len(PROMPT), content_digest(PROMPT))
    assert not refused.session and refused.reason == pb.CLONE_REFUSAL_PREPARED_INPUT
