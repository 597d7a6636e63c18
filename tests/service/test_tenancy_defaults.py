"""Defaults that serve eight users (issue 21 item 4): with every flag at its default -- an engine of 32
sessions of 2048 positions with the CLI's per-owner quotas, the prefix service as ``forkline-prefix
--http_port 0`` starts it -- 8 concurrent OpenAI chat requests without ``max_tokens`` and without
tokens all succeed (none is a 429).

Before, every unauthenticated HTTP request was the one owner ``anonymous``, whose quota is a quarter
of the engine's sessions (8): eight live generations fill it, and the prompt snapshot each one hands
to the prefix service counts against its giver until the service claims it, so a later request met
``owner 'anonymous' holds 8 sessions`` (429). Each request is now an owner of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import threading

import httpx

from engine_service.sessions.handles import engine_quotas
from prefix_service.__main__ import connect_and_serve
from prefix_service.__main__ import parse_args as prefix_args

MAX_SESSIONS, MAX_SESSION_TOKENS = 32, 2048
USERS = 8
TOKENS_EACH = 24  # read before closing: all eight generations are live together


def chat(base: str, model: str, i: int, all_started: threading.Barrier) -> tuple[int, int, str]:
    """A streamed chat without max_tokens: (status, content chunks read, error body)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"User {i} asks: what is the capital of France?"}],
        "stream": True,
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            all_started.abort()
            return response.status_code, 0, response.read().decode()[:300]
        chunks = 0
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                chunks += 1
                if chunks == 1:
                    with contextlib.suppress(threading.BrokenBarrierError):  # another was refused
                        all_started.wait(30)  # keep streaming until every request has its first token
                if chunks >= TOKENS_EACH:
                    break
        return 200, chunks, ""


def test_eight_concurrent_chats_without_max_tokens_all_succeed(engine_factory, capsys) -> None:
    quota, budget = engine_quotas(MAX_SESSIONS, MAX_SESSION_TOKENS)
    assert (quota.max_sessions, quota.max_positions) == (8, 8192)
    engine = engine_factory(
        max_sessions=MAX_SESSIONS,
        max_session_tokens=MAX_SESSION_TOKENS,
        quota=quota,
        persistent_quota=budget,
    )
    server, _ = connect_and_serve(
        prefix_args(["--engine", engine.address, "--port", "0", "--http_port", "0"])
    )
    try:
        line = capsys.readouterr().out.strip().splitlines()[-1]
        base = "http://" + re.sub(r".* on ", "", line)
        barrier = threading.Barrier(USERS)
        with concurrent.futures.ThreadPoolExecutor(USERS) as pool:
            answers = list(pool.map(lambda i: chat(base, engine.deps.model_name, i, barrier), range(USERS)))
    finally:
        server.stop(0)
    assert [a[:2] for a in answers] == [(200, TOKENS_EACH)] * USERS, [a[2] for a in answers if a[2]]
