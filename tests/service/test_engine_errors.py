"""Each bad input gets its status code (never INTERNAL), while a healthy stream beside it is unaffected."""

from __future__ import annotations

import threading

import grpc
import pytest

from clients.engine_client import EngineClient
from engine_service.api import errors
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.serving.auth import OWNER_METADATA_KEY
from engine_service.serving.errors import code_for, error_for
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc
from tests.service.helpers import PROMPT, in_process_tokens, wait_for

HEALTHY_TOKENS = 80


class HealthyStream:
    """A greedy generation streamed in a thread while the bad requests run."""

    def __init__(self, address: str) -> None:
        self.client = EngineClient(address, owner="healthy")
        self.stream = self.client.generate(
            PROMPT, config=GenConfig(max_new_tokens=HEALTHY_TOKENS), ignore_eos=True
        )
        self.started = threading.Event()
        self.result = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        events = iter(self.stream)
        next(events)
        self.started.set()
        out = []
        done = None
        for e in events:
            out.extend(getattr(e, "ids", ()))
            done = getattr(e, "finish_reason", done)
        self.result = (out, done)

    def check(self) -> None:
        self.thread.join(60)
        assert self.result == (in_process_tokens(PROMPT, HEALTHY_TOKENS), "length")


def stub_and_meta(address: str, owner: str = "alice"):
    channel = grpc.insecure_channel(address)
    return engine_pb2_grpc.EngineStub(channel), ((OWNER_METADATA_KEY, owner),), channel


def expect_code(code: grpc.StatusCode, fn) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    return info.value.details()


def gen(stub, meta, **fields):
    return lambda: list(stub.Generate(pb.GenerateRequest(**fields), metadata=meta))


def test_bad_inputs_map_to_codes_beside_a_healthy_stream(engine) -> None:
    healthy = HealthyStream(engine.address)
    assert healthy.started.wait(30)
    stub, meta, channel = stub_and_meta(engine.address)
    alice = EngineClient(engine.address, owner="alice")
    own = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=2), keep_session=True)
        .collect()
        .started.session
    )
    instance, _ = own.split(".")
    INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    tokens = pb.TokenIds(ids=[65, 66])

    # unknown, forged (right instance, random bits), stale-instance and another owner's handles
    expect_code(NOT_FOUND, gen(stub, meta, session="nope", tokens=tokens))
    expect_code(NOT_FOUND, gen(stub, meta, session=f"{instance}.{'0' * 32}", tokens=tokens))
    assert "restarted" in expect_code(
        NOT_FOUND, gen(stub, meta, session=f"{'f' * 16}.{'0' * 32}", tokens=tokens)
    )
    _, bob_meta, _ = stub_and_meta(engine.address, "bob")
    expect_code(NOT_FOUND, gen(stub, bob_meta, session=own, tokens=tokens))
    expect_code(NOT_FOUND, lambda: stub.Clone(pb.CloneRequest(session=own, upto=1), metadata=bob_meta))
    expect_code(NOT_FOUND, lambda: stub.Close(pb.CloseRequest(session=own), metadata=bob_meta))
    expect_code(NOT_FOUND, lambda: stub.Describe(pb.DescribeRequest(session="x"), metadata=meta))
    # malformed input
    expect_code(INVALID, gen(stub, meta, tokens=pb.TokenIds(ids=[65, -1])))
    expect_code(INVALID, gen(stub, meta, tokens=pb.TokenIds(ids=[65, 128])))
    expect_code(INVALID, gen(stub, meta, tokens=pb.TokenIds(ids=[])))
    expect_code(INVALID, gen(stub, meta))
    expect_code(INVALID, gen(stub, meta, prepared=pb.PreparedInput(kind="pixels", payload=b"")))
    expect_code(
        INVALID, gen(stub, meta, prepared=pb.PreparedInput(kind="embeddings", payload=b"12", shape=[1, 64]))
    )
    # a registered kind this engine's executor does not accept (raw-token ModuleExecutor)
    zeros = pb.PreparedInput(kind="embeddings", payload=bytes(4 * 3 * 64), shape=[3, 64])
    assert "not supported" in expect_code(INVALID, gen(stub, meta, prepared=zeros))
    expect_code(INVALID, gen(stub, meta, tokens=tokens, config=pb.GenerationConfig(top_p=2.0)))
    expect_code(INVALID, gen(stub, meta, tokens=tokens, config=pb.GenerationConfig(max_new_tokens=0)))
    expect_code(INVALID, gen(stub, meta, tokens=tokens, capture=pb.CaptureOptions(breakpoints=[5])))
    expect_code(INVALID, gen(stub, meta, session=own, tokens=tokens, keep_session=True))
    expect_code(INVALID, lambda: stub.Detokenize(pb.DetokenizeRequest(ids=[999]), metadata=meta))
    expect_code(
        INVALID,
        lambda: stub.Describe(pb.DescribeRequest(session=own), metadata=((OWNER_METADATA_KEY, "x" * 500),)),
    )
    # a prompt over the session limit (256 positions)
    assert "max_session_tokens" in expect_code(INVALID, gen(stub, meta, tokens=pb.TokenIds(ids=[65] * 257)))
    expect_code(INVALID, gen(stub, meta, session=own, tokens=pb.TokenIds(ids=[65] * 200)))
    # the session the errors named is intact, and nothing leaked
    assert alice.describe(own) == (len(PROMPT) + 1, False)
    healthy.check()
    assert alice.release_owner() == 1
    assert wait_for(lambda: engine.runner.resident_sessions == 0)
    channel.close()


def test_engine_full_is_resource_exhausted(engine_factory) -> None:
    engine = engine_factory(max_sessions=3)
    alice = EngineClient(engine.address, owner="alice")
    held = [
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
        for _ in range(2)
    ]
    healthy = HealthyStream(engine.address)  # the third and last slot
    assert healthy.started.wait(30)
    stub, meta, channel = stub_and_meta(engine.address)
    expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, gen(stub, meta, tokens=pb.TokenIds(ids=[65, 66])))
    with pytest.raises(errors.ResourceExhausted):
        alice.generate([65], config=GenConfig(max_new_tokens=1)).collect()
    # a clone with no free slot is a refusal, not an error
    assert alice.clone(held[0], 10) is None
    healthy.check()
    alice.close(held[0])
    assert alice.generate([65, 66], config=GenConfig(max_new_tokens=1)).collect().done.generated_tokens == 1
    channel.close()


def test_session_already_generating_is_failed_precondition(engine_factory) -> None:
    engine = engine_factory(max_session_tokens=4096)
    alice = EngineClient(engine.address, owner="alice")
    stream = alice.generate(PROMPT, config=GenConfig(max_new_tokens=3000), ignore_eos=True)
    events = iter(stream)
    session = next(events).session
    next(events)
    with pytest.raises(errors.FailedPrecondition):
        alice.generate([65], session=session, config=GenConfig(max_new_tokens=1)).collect()
    stream.cancel()


def test_stopping_engine_is_unavailable_while_streams_finish(engine) -> None:
    healthy = HealthyStream(engine.address)
    assert healthy.started.wait(30)
    engine.server.deps.drain()  # what SIGTERM does first
    stub, meta, channel = stub_and_meta(engine.address)
    expect_code(grpc.StatusCode.UNAVAILABLE, gen(stub, meta, tokens=pb.TokenIds(ids=[65, 66])))
    expect_code(
        grpc.StatusCode.UNAVAILABLE, lambda: stub.Clone(pb.CloneRequest(session="x", upto=0), metadata=meta)
    )
    healthy.check()  # the stream in flight completes
    engine.stop(grace=5)
    expect_code(grpc.StatusCode.UNAVAILABLE, lambda: stub.Info(pb.InfoRequest(), metadata=meta, timeout=2))
    channel.close()


@pytest.mark.parametrize(
    ("error", "code", "client_type"),
    [
        (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (errors.ModelLoadError("p", "bad"), grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (ValueError("field"), None, None),  # a builtin error is a bug (INTERNAL), not an answer
        (errors.NotFound("h"), grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (errors.ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (errors.FailedPrecondition("busy"), grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
        (errors.Unavailable("stop"), grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (errors.GenerationError("boom"), grpc.StatusCode.ABORTED, errors.GenerationError),
        (RuntimeError("bug"), None, None),
    ],
)
def test_error_table_round_trips(error: Exception, code, client_type) -> None:
    assert code_for(error) == code
    if code is not None:
        assert type(error_for(code, "m")) is client_type


def test_clone_new_owner_is_validated_like_the_owner_metadata(engine) -> None:
    # A new_owner nobody can present as forkline-owner (over 128 characters) would make the clone
    # unreachable: refused before any clone, naming the field, and nothing is left behind.
    alice = EngineClient(engine.address, owner="alice")
    own = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    resident = engine.runner.resident_sessions
    stub, meta, channel = stub_and_meta(engine.address)
    details = expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: stub.Clone(pb.CloneRequest(session=own, upto=3, new_owner="x" * 129), metadata=meta),
    )
    assert "new_owner" in details
    assert engine.runner.resident_sessions == resident and len(engine.deps.registry) == 1
    # the longest valid owner passes the length check; a client may hand a clone only to a persistent owner
    with pytest.raises(InvalidArgument, match="only a persistent owner"):
        alice.clone(own, len(PROMPT), new_owner="y" * 128)
    assert alice.clone(own, len(PROMPT), new_owner="prefix-service") is not None
    channel.close()


def test_prepared_input_that_cannot_fit_the_model_is_invalid_argument(engine_factory) -> None:
    # Bad prepared content is bad input (INVALID_ARGUMENT naming the field), not a failed generation
    # (ABORTED): a hidden size other than the model's, and non-finite values.
    import math
    import struct

    engine = engine_factory(prepared_inputs=True)
    stub, meta, channel = stub_and_meta(engine.address)
    from engine_service.model.random_init import random_model

    hidden = random_model("FRFR", 4, 0).config.hidden_size  # the engine's model (conftest)

    def prepared(payload: bytes, shape: list[int]):
        return gen(
            stub,
            meta,
            prepared=pb.PreparedInput(kind="embeddings", payload=payload, shape=shape),
            config=pb.GenerationConfig(max_new_tokens=1),
        )

    wrong = hidden + 3
    assert "prepared.shape" in expect_code(
        grpc.StatusCode.INVALID_ARGUMENT, prepared(bytes(4 * 2 * wrong), [2, wrong])
    )
    nan = struct.pack("<f", math.nan) + bytes(4 * (2 * hidden - 1))
    assert "prepared.payload" in expect_code(grpc.StatusCode.INVALID_ARGUMENT, prepared(nan, [2, hidden]))
    inf = struct.pack("<f", -math.inf) * (2 * hidden)
    assert "prepared.payload" in expect_code(grpc.StatusCode.INVALID_ARGUMENT, prepared(inf, [2, hidden]))
    # control: a well-formed input of the same shape generates
    events = prepared(struct.pack("<f", 0.5) * (2 * hidden), [2, hidden])()
    assert events[-1].done.finish_reason in ("stop", "length")
    assert wait_for(lambda: engine.runner.resident_sessions == 0)
    channel.close()


def test_clone_that_does_not_settle_in_time_is_unavailable_not_internal(engine, monkeypatch) -> None:
    from concurrent.futures import Future

    from engine_service.runtime.session import Session
    from engine_service.sessions import clones as sessions_clones

    alice = EngineClient(engine.address, owner="alice")
    own = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    monkeypatch.setattr(sessions_clones, "CLONE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(
        Session, "clone_async", lambda self, upto, expected=None: Future()
    )  # a stalled engine
    stub, meta, channel = stub_and_meta(engine.address)
    details = expect_code(
        grpc.StatusCode.UNAVAILABLE,
        lambda: stub.Clone(pb.CloneRequest(session=own, upto=len(PROMPT)), metadata=meta),
    )
    assert "clone" in details
    channel.close()


def test_clone_whose_caller_gave_up_is_not_registered(engine, monkeypatch) -> None:
    # The caller's deadline passes while the engine clones: nobody will receive the handle, so the
    # child must be closed rather than registered (a persistent owner would hold it forever).
    import threading
    from concurrent.futures import Future

    from engine_service.runtime.session import Session

    alice = EngineClient(engine.address, owner="alice")
    own = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    resident, handles = engine.runner.resident_sessions, len(engine.deps.registry)
    real_clone = Session.clone_async

    def late_clone(self, upto, expected=None):
        late: Future = Future()
        inner = real_clone(self, upto, expected)
        threading.Timer(0.5, lambda: late.set_result(inner.result())).start()
        return late

    monkeypatch.setattr(Session, "clone_async", late_clone)
    stub, meta, channel = stub_and_meta(engine.address)
    expect_code(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        lambda: stub.Clone(pb.CloneRequest(session=own, upto=len(PROMPT)), metadata=meta, timeout=0.2),
    )
    monkeypatch.undo()
    assert wait_for(
        lambda: engine.runner.resident_sessions == resident and len(engine.deps.registry) == handles,
        timeout=60,
    ), (engine.runner.resident_sessions, len(engine.deps.registry))
    channel.close()


def test_clone_upto_and_content_digest_are_validated_naming_the_field(engine) -> None:
    INVALID = grpc.StatusCode.INVALID_ARGUMENT
    alice = EngineClient(engine.address, owner="alice")
    own = (
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    base = engine.runner.resident_sessions
    stub, meta, channel = stub_and_meta(engine.address)
    for upto in (-1, -(2**40)):
        details = expect_code(
            INVALID, lambda u=upto: stub.Clone(pb.CloneRequest(session=own, upto=u), metadata=meta)
        )
        assert details == f"upto must be >= 0, got {upto}"
    for size in (1, 15, 17, 32):
        request = pb.CloneRequest(session=own, upto=3, expected_content_digest=b"x" * size)
        details = expect_code(INVALID, lambda r=request: stub.Clone(r, metadata=meta))
        assert details == f"expected_content_digest must be empty or 16 bytes, got {size}"
    # past the committed position stays a refusal with its reason (not an error)
    past = stub.Clone(pb.CloneRequest(session=own, upto=len(PROMPT) + 1), metadata=meta)
    assert not past.session and past.reason == pb.CLONE_REFUSAL_POSITION and "outside" in past.refusal
    assert engine.runner.resident_sessions == base and alice.describe(own) == (len(PROMPT), False)
    channel.close()
