"""The HTTP door's lifecycle: its socket, clients that leave, the flag that starts it, stopping with the
prefix service, a door over several engines."""

from __future__ import annotations

import socket

import httpx
import pytest
from starlette.applications import Starlette

from prefix_service.__main__ import connect_and_serve
from prefix_service.__main__ import parse_args as prefix_args
from prefix_service.http.server import HttpServer
from tests.service.helpers import wait_for
from tests.service.http_door.calls import MODEL, engine_idle, sdk


def test_responses_are_not_held_back_by_nagle() -> None:
    """asyncio turns Nagle off only on connections of a socket made with IPPROTO_TCP; without it
    every whole (non-streamed) response waited ~40 ms for a delayed ACK."""
    http = HttpServer.start(Starlette(), "127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", http.port)) as client:
            client.sendall(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(100).startswith(b"HTTP/1.1 404")
        assert http._socket.proto == socket.IPPROTO_TCP
    finally:
        http.stop(0)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_leaves_no_engine_session(door, stream) -> None:
    """A long generation (900 tokens) is ended when its client leaves, long before it would finish."""
    engine, _, base = door
    body = {"model": MODEL, "prompt": "a", "max_tokens": 900, "temperature": 0, "stream": stream}
    decoded_before = engine.runner.metrics().tokens_decoded
    with httpx.Client(timeout=httpx.Timeout(30, read=None if stream else 0.3)) as http:
        if stream:
            with http.stream("POST", base + "/v1/completions", json=body) as s:
                assert next(line for line in s.iter_lines() if line.startswith("data: "))
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(base + "/v1/completions", json=body)
    assert wait_for(lambda: engine_idle(engine, held=1), timeout=10)
    assert engine.runner.metrics().tokens_decoded - decoded_before < 900  # ended, not run out


def test_the_prefix_service_flag_starts_the_door(engine, capsys) -> None:
    """``forkline-prefix --http_port 0`` wiring (in-process): the model id is the engine's model name."""
    args = prefix_args(["--engine", engine.address, "--port", "0", "--http_port", "0"])
    server, _ = connect_and_serve(args)
    try:
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith("forkline-prefix HTTP listening on 127.0.0.1:")
        models = httpx.get(f"http://{line.rsplit(' ', 1)[1]}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [engine.deps.model_name]
    finally:
        server.stop(0)
    assert prefix_args(["--engine", "x:1"]).http_port is None  # off by default


def test_stopping_the_prefix_service_stops_its_http_door(door) -> None:
    engine, prefix, base = door
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            base + "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 900, "stream": True},
        ) as s,
    ):
        assert next(line for line in s.iter_lines() if line.startswith("data: "))
        prefix.stop(0.2, release=True)
    with pytest.raises(httpx.ConnectError):
        httpx.get(base + "/health")
    assert wait_for(lambda: engine_idle(engine, held=0), timeout=10)


def test_the_door_routes_over_several_engines(engine_factory) -> None:
    """One prefix service over two engines: a repeated chat reuses its prompt, and under cache_aware
    (pinned: the default cost policy spreads such misses instead, tests/service/test_routing_tenants.py)
    a new question goes to the engine holding the longest shared prefix (the chat template's header)."""
    from prefix_service.engines.connect import connect_fleet
    from prefix_service.fleet.routing import routing_policy
    from prefix_service.rpc.server import create_server

    engines = [engine_factory(max_session_tokens=1024) for _ in range(2)]
    fleet, pool = connect_fleet(
        lambda: {e.address for e in engines},
        policy=routing_policy("cache_aware"),
        ready_timeout=10,
        resolve_every_s=60,
        cache_generated=False,  # it counts the prompt snapshots each engine holds
    )
    server, _ = create_server(fleet, "127.0.0.1:0", pool=pool)
    try:
        client = sdk(f"http://127.0.0.1:{server.start_http('127.0.0.1', 0, model_name=MODEL)}")
        questions = [
            [{"role": "user", "content": f"{q} is the capital of France?"}] for q in ("What", "Which city")
        ]
        header = len("<|im_start|>user\n")  # what the two chats share (one token per character)
        for i, messages in enumerate(questions):
            first = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0
            )
            again = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0
            )
            assert first.usage.prompt_tokens_details.cached_tokens == (0 if i == 0 else header + 2)  # + "Wh"
            assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
            assert again.choices[0].message.content == first.choices[0].message.content
        assert sorted(e.stats.cache.entries for e in fleet.stats().engines) == [
            0,
            2,
        ]  # both where the header is
    finally:
        server.stop(0)
