"""Calls on the HTTP door: the official ``openai`` client, raw JSON posts, event streams, and whether
the engine behind it is idle."""

from __future__ import annotations

import json

import httpx
import openai

from clients.engine_client import EngineClient
from engine_service.api.config import GenConfig
from tests.service.openai_door import MODEL

__all__ = ["MODEL", "QUESTION", "cold_real", "engine_idle", "post", "real_text", "sdk", "sse_events"]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)


def post(base: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        base + path, content=content, headers={"content-type": "application/json"}, timeout=30, **kw
    )


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of an event stream, parsed (``[DONE]`` kept as the string)."""
    lines = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def engine_idle(engine, held: int) -> bool:
    """Only the ``held`` stored snapshots are left in the engine: no generation session, no clone."""
    info = EngineClient(engine.address).info()
    return info.resident_sessions == held and info.open_handles == held


def cold_real(loaded, deps, ids: list[int], n: int) -> list[int]:
    """A packaged model's greedy run over ``ids`` on a fresh engine session (nothing cached), stopping
    at EOS: the reference of the real-model door tests."""
    config = GenConfig(max_new_tokens=n, stop_tokens=tuple(loaded.tokenizer.eos_token_ids))
    with deps.runner.open_session() as session:
        return list(session.generate_async(ids, config).wait(300).tokens)


def real_text(loaded, ids: list[int]) -> str:
    return loaded.tokenizer.decode(ids, skip_special_tokens=True)
