"""Calls for the Messages API tests: the official ``anthropic`` client, raw event streams, and the
engine's own tokenization (the independent reference for positions)."""

from __future__ import annotations

import json

import anthropic
import grpc
import httpx

from protos import engine_pb2 as pb
from protos import engine_pb2_grpc

GREEDY = {"temperature": 0}  # the installed client has no temperature argument: sent as an extra field
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


def claude(base: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=30)


def engine_tokens(engine, turns: list[tuple[str, str]]) -> list[int]:
    """The engine's tokenization of a chat conversation (its template, with the generation prompt)."""
    messages = [pb.ChatMessage(role=r, content=c) for r, c in turns]
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return list(stub.Tokenize(pb.TokenizeRequest(text=pb.TextInput(chat=True, messages=messages))).ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def event_stream(base: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a streamed Messages call."""
    events, name = [], None
    with httpx.stream("POST", base + "/v1/messages", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events
