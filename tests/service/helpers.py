"""Shared test helpers: an in-process reference run (no gRPC) and polling."""

from __future__ import annotations

import time
from functools import lru_cache

from clients.engine_client import GenerationOutcome, GenerationStream
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.executors.module import ModuleExecutor
from engine_service.model.random_init import random_model
from engine_service.runtime.runner import Runner

PROMPT = [ord(c) for c in "The quick brown fox jumps over the lazy dog. "] * 2


def sampled(max_new_tokens: int) -> dict:
    """A client ``generate``'s sampling keywords (the tiny random model is very peaked: temperature 10)."""
    return {"config": GenConfig(max_new_tokens=max_new_tokens, temperature=10.0, seed=7), "ignore_eos": True}


@lru_cache(maxsize=64)
def _reference(
    prompt: tuple[int, ...], max_new_tokens: int, temperature: float, seed: int
) -> tuple[int, ...]:
    executor = ModuleExecutor.create(
        random_model("FRFR", 4, 0), "batched-sequence", 2, 4096, prefill_chunk=64
    )
    runner = Runner(executor)
    try:
        with runner.open_session() as session:
            config = GenConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
            return session.generate_async(list(prompt), config).wait(60).tokens
    finally:
        runner.shutdown()


def in_process_tokens(
    prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0
) -> list[int]:
    """Independent reference: the same tiny model (seed 0, FRFR) in a fresh Runner in this process."""
    return list(_reference(tuple(prompt), max_new_tokens, temperature, seed))


def send_as_is(client, request) -> GenerationOutcome:
    """``request`` (an engine or gateway Generate) over ``client``'s stub, unchecked: a config the
    clients' GenConfig refuses reaches the service, which must refuse it."""
    return GenerationStream(client.stub.Generate(request, metadata=client._metadata)).collect()


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def gateway_round(prefix, prompt=PROMPT, max_new_tokens=10, **kw):
    """One collected gateway Generate as alice on ``prefix`` (max_new_tokens 10 unless ``config``)."""
    kw.setdefault("config", GenConfig(max_new_tokens=max_new_tokens))
    return PrefixClient(prefix.address, owner="alice").generate(prompt, **kw).collect()
