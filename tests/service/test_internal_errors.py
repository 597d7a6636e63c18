"""Errors never hide bugs: only forkline's own error types are answers to a client.

A builtin exception escaping a servicer (a ``KeyError`` from a dict lookup, an ``IndexError``, a
``ValueError`` from a broken internal contract) is a bug. The client sees INTERNAL with a generic
message -- never NOT_FOUND / INVALID_ARGUMENT, and never the exception's text -- and the server logs
the traceback exactly once. Forkline's deliberate errors (negative control) keep their codes and
messages and log nothing.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from engine_service.api import errors
from engine_service.runtime.session import Session
from engine_service.serving.auth import OWNER_METADATA_KEY
from engine_service.serving.errors import INTERNAL_DETAILS, code_for
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc
from tests.service.helpers import PROMPT, wait_for

SECRET = "internal-dict-key-7f3a"  # the text of the injected bug, which must not reach the client
META = ((OWNER_METADATA_KEY, "alice"),)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (KeyError(SECRET), None),
        (IndexError(SECRET), None),
        (ValueError(SECRET), None),
        (LookupError(SECRET), None),
        (TypeError(SECRET), None),
        (RuntimeError(SECRET), None),
        (AttributeError(SECRET), None),
        (errors.InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ModelLoadError("p", "bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound("h"), grpc.StatusCode.NOT_FOUND),
        (errors.ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.FailedPrecondition("busy"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.Unavailable("stop"), grpc.StatusCode.UNAVAILABLE),
        (errors.Cancelled("gone"), grpc.StatusCode.CANCELLED),
        (errors.CacheError("misuse"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.GenerationError("boom"), grpc.StatusCode.ABORTED),
        (errors.ForklineError("other"), grpc.StatusCode.UNKNOWN),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_only_forkline_errors_have_a_client_code(error: BaseException, code) -> None:
    assert code_for(error) == code


@pytest.fixture
def stub(engine):
    channel = grpc.insecure_channel(engine.address)
    yield engine_pb2_grpc.EngineStub(channel)
    channel.close()


def raising(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc

    return fail


def failed_call(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def logged_tracebacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info is not None]


def check_internal(caplog, rpc_error: grpc.RpcError, bug: type[BaseException]) -> None:
    assert rpc_error.code() == grpc.StatusCode.INTERNAL, rpc_error.details()
    assert rpc_error.details() == INTERNAL_DETAILS
    assert SECRET not in rpc_error.details() and bug.__name__ not in rpc_error.details()
    (record,) = logged_tracebacks(caplog)  # exactly one, with the traceback
    assert record.levelno == logging.ERROR and record.exc_info[0] is bug
    assert SECRET in str(record.exc_info[1])


def tokenize(stub):
    return lambda: stub.Tokenize(pb.TokenizeRequest(text=pb.TextInput(text="hi")), metadata=META)


@pytest.mark.parametrize("bug", [KeyError, IndexError, ValueError])
def test_a_builtin_error_in_a_unary_call_is_internal_and_logged_once(
    engine, stub, caplog, monkeypatch, bug
) -> None:
    caplog.set_level(logging.ERROR)
    monkeypatch.setattr(engine.deps.tokenizer, "encode", raising(bug(SECRET)))
    check_internal(caplog, failed_call(tokenize(stub)), bug)


def test_a_keyerror_in_a_handle_lookup_is_internal_not_not_found(engine, stub, caplog, monkeypatch) -> None:
    # The registry is where a NOT_FOUND is expected; a KeyError bug there must not pass for one.
    caplog.set_level(logging.ERROR)
    monkeypatch.setattr(engine.deps.registry, "resolve", raising(KeyError(SECRET)))
    check_internal(
        caplog, failed_call(lambda: stub.Describe(pb.DescribeRequest(session="x"), metadata=META)), KeyError
    )


def test_a_keyerror_in_a_streamed_generate_is_internal_and_releases_the_session(
    engine, stub, caplog, monkeypatch
) -> None:
    # The bug strikes after the stream started (detokenizing the first tokens): the client has its
    # started event, then INTERNAL; the fresh session is closed all the same.
    caplog.set_level(logging.ERROR)
    monkeypatch.setattr(engine.deps.tokenizer, "decode", raising(KeyError(SECRET)))
    received = []

    def generate():
        request = pb.GenerateRequest(
            tokens=pb.TokenIds(ids=PROMPT), config=pb.GenerationConfig(max_new_tokens=4)
        )
        for event in stub.Generate(request, metadata=META):
            received.append(event.WhichOneof("event"))

    check_internal(caplog, failed_call(generate), KeyError)
    assert received[0] == "started" and "done" not in received
    assert wait_for(lambda: engine.runner.resident_sessions == 0) and len(engine.deps.registry) == 0


def test_a_builtin_error_from_a_clone_future_is_internal(engine, stub, caplog, monkeypatch) -> None:
    from concurrent.futures import Future

    request = pb.GenerateRequest(
        tokens=pb.TokenIds(ids=PROMPT), keep_session=True, config=pb.GenerationConfig(max_new_tokens=1)
    )
    session = list(stub.Generate(request, metadata=META))[0].started.session  # kept: the stream completed
    broken: Future = Future()
    broken.set_exception(IndexError(SECRET))  # what a bug on the engine thread settles the future with
    monkeypatch.setattr(Session, "clone_async", lambda self, upto, expected=None: broken)
    caplog.set_level(logging.ERROR)
    rpc_error = failed_call(lambda: stub.Clone(pb.CloneRequest(session=session, upto=3), metadata=META))
    check_internal(caplog, rpc_error, IndexError)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.NotFound(f"no such thing: {SECRET}"), grpc.StatusCode.NOT_FOUND),
        (errors.InvalidArgument(f"text: {SECRET} is not allowed"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.ResourceExhausted(f"full: {SECRET}"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_forkline_errors_keep_their_code_and_message_and_log_nothing(
    engine, stub, caplog, monkeypatch, error, code
) -> None:
    """Negative control: the same injection with a deliberate error is an answer, not a bug."""
    caplog.set_level(logging.ERROR)
    monkeypatch.setattr(engine.deps.tokenizer, "encode", raising(error))
    rpc_error = failed_call(tokenize(stub))
    assert rpc_error.code() == code
    assert rpc_error.details() == str(error)
    assert logged_tracebacks(caplog) == []


def test_an_input_error_from_domain_validation_is_invalid_argument(engine, stub, caplog) -> None:
    """Validation in domain code raises forkline's InvalidArgument (GenConfig, SamplingParams, ...)."""
    caplog.set_level(logging.ERROR)
    request = pb.GenerateRequest(
        tokens=pb.TokenIds(ids=PROMPT), config=pb.GenerationConfig(temperature=float("nan"))
    )
    rpc_error = failed_call(lambda: list(stub.Generate(request, metadata=META)))
    assert rpc_error.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in rpc_error.details()
    assert logged_tracebacks(caplog) == []


def _domain_validators():
    """Callers' mistakes caught by domain code, each of which must raise a forkline type."""
    from engine_service.api.config import GenConfig
    from engine_service.cache.config import CacheConfig, LayerSpec
    from engine_service.executors.sampling import SamplingParams
    from engine_service.model.config import ModelConfig, parse_layer_pattern
    from engine_service.model.formats.weights import resolve_weights_dtype
    from engine_service.model.text.chat import ChatFormatter
    from tests.service.conftest import char_tokenizer

    full = (LayerSpec(),)
    return {  # name: (the mistake, what the message names)
        "GenConfig.top_p": (lambda: GenConfig(top_p=2.0), "top_p"),
        "SamplingParams.top_k": (lambda: SamplingParams(top_k=-1), "top_k"),
        "LayerSpec.kind": (lambda: LayerSpec(kind="diagonal"), "kind"),
        "CacheConfig.capacity": (
            lambda: CacheConfig(capacity=0, max_seqs=1, layers=full, kv_heads=1, head_dim=8),
            "capacity",
        ),
        "ModelConfig.head_dim": (
            lambda: ModelConfig(
                vocab_size=8,
                hidden_size=8,
                num_layers=1,
                num_heads=1,
                num_kv_heads=1,
                head_dim=3,
                intermediate_size=8,
                layers=full,
            ),
            "head_dim",
        ),
        "layer pattern": (lambda: parse_layer_pattern("FX", 4), "layer pattern"),
        "chat format name": (lambda: ChatFormatter(name="no-such-format"), "chat format"),
        "chat messages": (lambda: ChatFormatter(name="chatml").format([{"role": "user"}]), "messages[0]"),
        "weights dtype": (lambda: resolve_weights_dtype("float7"), "weights_dtype"),
        "token id": (lambda: char_tokenizer().decode([999]), "999"),
    }


@pytest.mark.parametrize("name", list(_domain_validators()))
def test_domain_validation_raises_invalid_argument(name: str) -> None:
    mistake, named = _domain_validators()[name]
    with pytest.raises(errors.InvalidArgument) as info:
        mistake()
    assert named in str(info.value)
