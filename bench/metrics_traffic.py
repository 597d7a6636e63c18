"""The load generator of bench_metrics' dashboard run: mixed gateway traffic (chat prompts sharing system
prompts, raw prompts that mostly miss, a few invalid requests) from several client threads."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from clients.engine_client import GenerationStream
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError
from protos import engine_pb2, prefix_pb2

SYSTEMS = [
    "You are a patient geography tutor. Answer in two sentences, name the country and one fact about it, "
    "and never use lists. If the question is ambiguous, pick the most common reading and say so briefly.",
    "You are a concise cooking assistant. Give the single most important step first, then one tip that "
    "saves time. Use metric units and keep the whole answer under fifty words.",
    "You are a friendly astronomy guide for children. Use simple words, one comparison to everyday life, "
    "and end with a question that invites the child to look at the night sky.",
]

QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How do I boil an egg?",
    "What is a comet?",
    "Where is Mount Kilimanjaro?",
    "How long should pasta cook?",
    "Why does the Moon change shape?",
    "What is the largest desert?",
    "How do I make rice fluffy?",
    "What is a black hole?",
    "Which river is the longest?",
    "How do I keep bread fresh?",
]

WORDS = [
    "Tell",
    "Explain",
    "Describe",
    "Imagine",
    "Compare",
    "Summarize",
    "List",
    "Translate",
    "Recall",
    "Define",
    "Picture",
    "Outline",
    "Sketch",
    "Name",
    "Consider",
    "Suppose",
]


def traffic(prefix_address: str, seconds: float, clients: int, seed: int) -> dict[str, int]:
    """Mixed gateway traffic from ``clients`` threads for ``seconds``; returns what was sent."""
    sent: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(seed + i)
        prefix = PrefixClient(prefix_address, owner=f"client-{i}")
        while time.monotonic() < deadline:
            r = rng.random()
            question = rng.choice(QUESTIONS)
            new_tokens = rng.choice([8, 16, 24, 32])
            try:
                if r < 0.06:
                    kind = "invalid"
                    # sent as is: the client's GenConfig refuses max_new_tokens 0, the gateway must too
                    zero = engine_pb2.GenerationConfig(max_new_tokens=0)
                    request = prefix_pb2.GatewayGenerateRequest(
                        text=engine_pb2.TextInput(text=question, chat=True, add_special_tokens=True),
                        config=zero,
                    )
                    GenerationStream(prefix.stub.Generate(request, metadata=prefix._metadata)).collect()
                elif r < 0.3:
                    kind = "raw"
                    prefix.generate(
                        text=f"{rng.choice(WORDS)} {rng.randrange(10**6)}: {question}",
                        config=GenConfig(max_new_tokens=new_tokens, temperature=0.0),
                    ).collect()
                else:
                    kind = "chat"
                    prefix.generate(
                        text=question,
                        system=rng.choice(SYSTEMS),
                        chat=True,
                        config=GenConfig(max_new_tokens=new_tokens, temperature=0.0),
                    ).collect()
            except ForklineError:
                pass
            with lock:
                sent[kind] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(sent)
