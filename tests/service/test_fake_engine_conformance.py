"""The fake engine of the prefix unit tests (``tests/unit/prefix/fake_engine.FakeEngine``) follows the real
backend (``prefix_service.engines.engine_backend.EngineBackend``'s parts over a real engine): the same
members of the ``GatewayBackend`` and ``SessionBackend`` protocols with the protocols' signatures, and, situation by situation, the
same kind of answer (its type and the fields the gateway reads) or the same error type. A change to
either that leaves the other behind fails here; the negative controls show that each check sees a
missing member, another signature and another answer."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from clients.engine_client import EngineClient
from clients.runner_backend import RunnerBackend
from engine_service.api.answers import Described, TakenClone
from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import ForklineError, InvalidArgument, NotFound
from engine_service.api.prompts import TextPrompt, Tokenized
from prefix_service.cache.session_backend import CaptureBackend, SessionBackend
from prefix_service.engines.connect import connect_engine
from prefix_service.engines.engine_calls import EngineCalls
from prefix_service.engines.engine_sessions import RemoteSessions
from prefix_service.engines.snapshot_files import EngineSnapshots
from prefix_service.gateway.gateway_backend import EngineGenerate, GatewayBackend
from prefix_service.tier.snapshot_backend import SnapshotBackend
from tests.service.helpers import PROMPT
from tests.unit.prefix.fake_engine import FakeEngine
from tests.unit.prefix.fakes import FakeBackend

P = tuple(PROMPT)
ALICE = CallContext("alice")

# -- the members and their signatures -------------------------------------------------------------


def protocol_members(protocol: type) -> dict[str, Any]:
    """The protocol's members (its bases' included), as declared: functions and properties."""
    members: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                members[name] = value
    return members


def parameters(function: Callable) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter after ``self``."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params]


def conformance_errors(protocol: type, implementation: type, instance: object) -> list[str]:
    """How ``implementation`` (and ``instance`` of it, for attributes set in ``__init__``) departs
    from ``protocol``: a member missing, a method where a value is declared or the other way round,
    parameters other than the protocol's (names, kinds, defaults; extra ones must have defaults)."""
    errors = []
    for name, declared in protocol_members(protocol).items():
        if not hasattr(instance, name):
            errors.append(f"{name}: missing")
            continue
        found = inspect.getattr_static(implementation, name, None)
        if isinstance(declared, property):
            if callable(getattr(instance, name)):
                errors.append(f"{name}: a method, the protocol declares a value")
            continue
        if not inspect.isfunction(found):
            errors.append(f"{name}: not a method")
            continue
        want, have = parameters(declared), parameters(found)
        extra = have[len(want) :]
        if have[: len(want)] != want or any(default is inspect.Parameter.empty for _, _, default in extra):
            errors.append(
                f"{name}{inspect.signature(found)}: the protocol says {inspect.signature(declared)}"
            )
    return errors


@pytest.fixture
def real(engine_factory) -> tuple[EngineCalls, EngineClient]:
    engine = engine_factory(layers="FFFF")  # no sliding window: a clone may reach any position
    gateway, channel = connect_engine(engine.address)
    yield gateway.backend, EngineClient(engine.address, owner="alice")
    channel.close()


def test_both_backends_have_the_protocols_members_and_signatures(real) -> None:
    backend, _ = real
    assert isinstance(backend, GatewayBackend) and isinstance(FakeEngine(), GatewayBackend)
    assert conformance_errors(GatewayBackend, EngineCalls, backend) == []
    assert conformance_errors(GatewayBackend, FakeEngine, FakeEngine()) == []
    assert isinstance(backend.sessions, SessionBackend)
    assert conformance_errors(SessionBackend, RemoteSessions, backend.sessions) == []
    assert conformance_errors(SessionBackend, FakeEngine, FakeEngine()) == []
    assert isinstance(backend.snapshot_files(), SnapshotBackend) and FakeEngine().snapshot_files() is None


def test_the_cache_backends_have_the_capture_protocols_signatures() -> None:
    """The cache's fake (``FakeBackend``) and the in-process backend (``RunnerBackend``) alike; both
    engine backends meet the tier's protocol (the CLI's folder is the tier over ``RunnerBackend``)."""
    assert conformance_errors(CaptureBackend, FakeBackend, FakeBackend()) == []
    assert conformance_errors(CaptureBackend, RunnerBackend, RunnerBackend) == []
    assert conformance_errors(SnapshotBackend, RunnerBackend, RunnerBackend) == []
    assert conformance_errors(SnapshotBackend, EngineSnapshots, EngineSnapshots) == []


def test_the_signature_check_sees_a_missing_member_and_another_signature() -> None:
    """Negative control: a fake without ``reclaim``, with another ``take_clone`` signature, a method
    for the ``owner`` value and a required extra parameter is flagged for each."""

    class Drifted(FakeEngine):
        reclaim = None  # type: ignore[assignment]

        def take_clone(self, session, upto, call):  # no expected_digest
            return super().take_clone(session, upto, call)

        def tokenize(self, text, call, strict):  # an extra parameter without a default
            return super().tokenize(text, call)

    drifted = Drifted()
    drifted.owner = lambda: "prefix-service"  # type: ignore[method-assign]
    errors = conformance_errors(GatewayBackend, Drifted, drifted)
    assert sorted(e.split(":")[0].split("(")[0] for e in errors) == [
        "owner",
        "reclaim",
        "take_clone",
        "tokenize",
    ]


# -- the same situations, the same answers ----------------------------------------------------------


@dataclass
class World:
    """A backend (the gateway's calls and the cache's sessions of one engine) and a way to give the
    caller ``alice`` a session holding given tokens."""

    backend: Any
    sessions: Any
    session: Callable[[tuple[int, ...]], Any]


def real_world(real) -> World:
    backend, alice = real
    backend.refresh()

    def session(tokens: tuple[int, ...]) -> str:
        return (
            alice.generate(list(tokens), config=GenConfig(max_new_tokens=1), keep_session=True)
            .collect()
            .started.session
        )

    return World(backend, backend.sessions, session)


def fake_world(fake: FakeEngine | None = None) -> World:
    fake = fake or FakeEngine()
    fake.refresh()
    return World(fake, fake, lambda tokens: fake.open(tokens))


def answer(call: Callable[[], Any]) -> Any:
    """What a call came to: its value, or the type of the forkline error it raised."""
    try:
        return call()
    except ForklineError as exc:
        return type(exc)


def taken(result: Any) -> Any:
    """A take_clone / clone_or_refusal answer as the gateway reads it: a handle or the refusal."""
    if isinstance(result, TakenClone):
        return ("handle", result.refusal) if result.handle is not None else (None, result.refusal)
    return result


def events(stream) -> list[str]:
    """The event types of an engine stream, runs of Tokens as one."""
    kinds: list[str] = []
    for event in stream:
        kind = type(event).__name__
        if not kinds or kinds[-1] != kind or kind != "Tokens":
            kinds.append(kind)
    return kinds


def observe(world: World) -> dict[str, Any]:
    """One observation per situation the gateway meets."""
    b, sessions, seen = world.backend, world.sessions, {}
    s = world.session(P)
    seen["info"] = type(b.info())
    seen["tokenize"] = b.tokenize(TextPrompt("Hi"), ALICE)
    d = b.describe(s, ALICE)
    seen["describe"] = (type(d), d.position, d.content_digest == content_digest(P))
    clone = b.take_clone(s, 5, ALICE)
    seen["take_clone"] = taken(clone)
    h = clone.handle
    seen["clone held"] = (
        sessions.valid(h),
        sessions.position(h),
        sessions.content_digest(h) == content_digest(P[:5]),
    )
    seen["claim"] = answer(lambda: b.claim(h))
    seen["claim again"] = answer(lambda: b.claim(h))
    seen["take_clone past the position"] = taken(answer(lambda: b.take_clone(s, len(P) + 1, ALICE)))
    seen["take_clone, other content"] = taken(
        answer(lambda: b.take_clone(s, 5, ALICE, content_digest(P[1:6])))
    )
    seen["clone_or_refusal"] = taken(sessions.clone_or_refusal(h, 3))
    seen["clone_or_refusal past the position"] = taken(sessions.clone_or_refusal(h, 6))
    seen["clone past the position"] = sessions.clone(h, 6)
    sessions.close(h)
    seen["closed handle"] = (sessions.valid(h), answer(lambda: sessions.close(h)))
    seen["claim, closed"] = answer(lambda: b.claim(h))
    seen["reclaim"] = type(b.reclaim())
    gone = world.session(P)
    seen["close_as"] = answer(lambda: b.close_as(gone, ALICE))
    seen["close_as again"] = answer(lambda: b.close_as(gone, ALICE))
    seen["describe, closed"] = answer(lambda: b.describe(gone, ALICE))
    seen["take_clone, closed"] = taken(answer(lambda: b.take_clone(gone, 1, ALICE)))
    config = GenConfig(max_new_tokens=2)
    if isinstance(b, FakeEngine):
        b.answer = (500, 501)  # the fake's scripted answer, as long as the engine's (max_new_tokens=2)
    fresh = EngineGenerate("", P, config, ignore_eos=True, prompt_snapshot=True, call=ALICE)
    seen["generate"] = events(b.generate(fresh))
    given = world.session(P)
    seen["generate, close_session"] = events(
        b.generate(EngineGenerate(given, (7,), config, ignore_eos=True, call=ALICE, close_session=True))
    )
    seen["session after close_session"] = answer(lambda: b.describe(given, ALICE))
    final = list(b.generate(EngineGenerate("", P, config, ignore_eos=True, call=ALICE, final_snapshot=True)))
    snaps = [(str(e.kind), e.position, e.handle is not None) for e in final if type(e).__name__ == "Snapshot"]
    seen["generate, final_snapshot"] = (events(final), snaps)
    wrong = EngineGenerate("", P, config, call=ALICE, close_session=True)
    seen["close_session without a session"] = answer(lambda: events(b.generate(wrong)))
    return seen


EXPECTED = {  # what both backends answer (the real engine's answers, which the fake follows)
    "info": EngineInfo,
    "tokenize": Tokenized((72, 105)),
    "describe": (Described, len(P), True),
    "take_clone": ("handle", None),
    "clone held": (True, 5, True),
    "claim": None,
    "claim again": None,
    "take_clone past the position": (None, "position"),
    "take_clone, other content": (None, "content_mismatch"),
    "clone_or_refusal": ("handle", None),
    "clone_or_refusal past the position": (None, "position"),
    "clone past the position": None,
    "closed handle": (False, None),
    "claim, closed": NotFound,
    "reclaim": int,
    "close_as": None,
    "close_as again": NotFound,
    "describe, closed": NotFound,
    "take_clone, closed": NotFound,
    "generate": ["Started", "Tokens", "Snapshot", "Tokens", "Done"],
    "generate, close_session": ["Started", "Tokens", "Done"],
    # the last committed token: the prompt and the first of the two generated (the second is pending)
    "generate, final_snapshot": (
        ["Started", "Tokens", "Snapshot", "Done"],
        [("generated", len(P) + 1, True)],
    ),
    "session after close_session": NotFound,
    "close_session without a session": InvalidArgument,
}


def test_the_fake_answers_as_the_real_backend_does(real) -> None:
    assert observe(real_world(real)) == EXPECTED
    assert observe(fake_world()) == EXPECTED


def test_the_situation_check_sees_another_answer() -> None:
    """Negative control: a fake that describes a closed session instead of NotFound, and refuses a
    clone past the position for another reason, is told apart."""

    class Lax(FakeEngine):
        def describe(self, session, call):
            return Described(session.position) if session.closed else super().describe(session, call)

        def clone_or_refusal(self, handle, upto):
            child = self.clone(handle, upto)
            return TakenClone(child) if child is not None else TakenClone(None, "boundary")

    seen = observe(fake_world(Lax()))
    differ = sorted(k for k in EXPECTED if seen[k] != EXPECTED[k])
    assert differ == ["clone_or_refusal past the position", "describe, closed", "session after close_session"]
