"""An HTTP door over real engine and prefix servers (tiny model) with the official ``openai`` client."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import openai

from tests.service.conftest import Engine, Prefix, start_engine, start_prefix

MODEL = "tiny"


class Door(NamedTuple):
    engine: Engine
    client: openai.OpenAI
    prefix: Prefix


@contextlib.contextmanager
def openai_door(**engine_kwargs) -> Iterator[Door]:
    """The door of a prefix service over a fresh engine (``start_engine`` kwargs) and a client for
    it; both servers stop at the end."""
    engine = start_engine(**engine_kwargs)
    prefix = start_prefix(engine.address)
    try:
        port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        yield Door(engine, client, prefix)
    finally:
        prefix.stop(0)
        engine.stop(0)
