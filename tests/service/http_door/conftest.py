"""The HTTP door's fixtures: a tiny engine (char tokenizer: one token per character, chatml template)
behind a prefix service whose HTTP door is started like ``forkline-prefix --http_port 0`` does
(``PrefixServer.start_http``)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.service.conftest import start_engine, start_prefix
from tests.service.http_door.calls import MODEL, sdk


@pytest.fixture
def door(engine_factory, prefix_factory):
    """(engine, prefix service, base URL) with the HTTP door on a free port."""
    engine = engine_factory(max_session_tokens=1024)
    prefix = prefix_factory(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    return engine, prefix, f"http://127.0.0.1:{port}"


@pytest.fixture
def prompts_door(engine_factory, prefix_factory):
    """As ``door``, its service storing prompt snapshots only (--no-cache_generated): for the tests
    that count the snapshots a call leaves."""
    engine = engine_factory(max_session_tokens=1024)
    prefix = prefix_factory(engine.address, cache_generated=False)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    return engine, prefix, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def shared_base() -> Iterator[str]:
    """One door for the tests that only read answers (no engine state): the base URL."""
    engine = start_engine(max_session_tokens=1024)
    prefix = start_prefix(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
    yield f"http://127.0.0.1:{port}"
    prefix.stop(0)
    engine.stop(0)


@pytest.fixture
def client(door) -> openai.OpenAI:
    return sdk(door[2])
