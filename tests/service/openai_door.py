"""An HTTP door over real engine and prefix servers (tiny model) with the official ``openai`` client."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai

from tests.service.conftest import Engine, start_engine, start_prefix

MODEL = "tiny"


@contextlib.contextmanager
def openai_door(**engine_kwargs) -> Iterator[tuple[Engine, openai.OpenAI]]:
    """(engine, client) for the door of a prefix service over a fresh engine (``start_engine`` kwargs);
    both servers stop at the end."""
    engine = start_engine(**engine_kwargs)
    prefix = start_prefix(engine.address)
    try:
        port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
        yield (
            engine,
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60),
        )
    finally:
        prefix.stop(0)
        engine.stop(0)
