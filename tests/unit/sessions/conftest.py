"""Sessions-layer fixtures: EngineSessions over a Runner over the fake executor (no model, no gRPC)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine_service.api.config import GenConfig
from engine_service.api.owners import NO_QUOTA, PERSISTENT_OWNER, OwnerQuota
from engine_service.api.stream_events import Done, Event, Snapshot, Started, Tokens
from engine_service.model.text.tokenizer import Tokenizer
from engine_service.runtime.runner import Runner
from engine_service.sessions.engine import EngineSessions, GenerationRequest
from engine_service.sessions.handles import HandleRegistry
from tests.unit.runtime.fake_executor import FakeExecutor

VOCAB = 128  # the char tokenizer's: ids 3..127 are ASCII characters
PERSISTENT = PERSISTENT_OWNER


def char_tokenizer() -> Tokenizer:
    specials = {"<unk>": 0, "<bos>": 1, "<eos>": 2}
    backend = HFTokenizer(
        models.WordLevel(vocab=specials | {chr(i): i for i in range(3, VOCAB)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(specials))
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=(2,), add_bos=True)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return char_tokenizer()


@pytest.fixture
def make_sessions(tokenizer) -> Iterator[Callable[..., EngineSessions]]:
    """``make_sessions(quota=, persistent_quota=, max_session_tokens=, growth=, ...)``; every runner is
    shut down at teardown."""
    made: list[Runner] = []

    def make(
        *,
        quota: OwnerQuota = NO_QUOTA,
        persistent_quota: OwnerQuota = NO_QUOTA,
        max_sessions: int = 16,
        max_session_tokens: int = 256,
        growth: int | None = None,
        idle_timeout_s: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> EngineSessions:
        fake = FakeExecutor(
            vocab_size=VOCAB, max_sessions=max_sessions, max_session_tokens=max_session_tokens
        )
        runner = Runner(fake)
        made.append(runner)
        registry_kw = {"clock": clock} if clock is not None else {}
        registry: HandleRegistry = HandleRegistry(
            idle_timeout_s=idle_timeout_s,
            persistent_owners=frozenset({PERSISTENT}),
            quota=quota,
            persistent_quota=persistent_quota,
            **registry_kw,
        )
        return EngineSessions(
            runner=runner,
            tokenizer=tokenizer,
            limits=runner.limits,
            model_name="fake",
            cache_kind="fake",
            registry=registry,
            reservation_growth=growth,
        )

    yield make
    for runner in made:
        runner.shutdown(10)


@pytest.fixture
def sessions(make_sessions) -> EngineSessions:
    return make_sessions()


def run(
    engine: EngineSessions, owner: str, tokens: list[int], max_new_tokens: int = 4, **request
) -> list[Event]:
    """Every event of one generation, its call finished however it ended."""
    config = request.pop("config", GenConfig(max_new_tokens=max_new_tokens))
    call = engine.generate(owner, GenerationRequest(tokens, config, **request))
    try:
        return list(call.events(lambda: True))
    finally:
        call.finish()


def started(events: list[Event]) -> Started:
    return next(e for e in events if isinstance(e, Started))


def done(events: list[Event]) -> Done:
    return next(e for e in events if isinstance(e, Done))


def generated(events: list[Event]) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) for t in e.ids]


def snapshots(events: list[Event]) -> list[Snapshot]:
    return [e for e in events if isinstance(e, Snapshot)]


def resident(engine: EngineSessions) -> int:
    """Sessions the engine thread holds once every queued close has been handled (twice: a clone
    handled before the first barrier queues its child's close behind it)."""
    engine.runner.flush(10)
    engine.runner.flush(10)
    return engine.runner.resident_sessions
