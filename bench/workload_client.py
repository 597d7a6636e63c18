"""The workload bench's clients: one streamed OpenAI request (time to first token, the usage's cached
tokens), a workload's stages run by concurrent clients or at trace times, and the prompt ids each server
saw (its own tokenizer) for the ideal cache.

A chat model gets ``/v1/chat/completions`` (system + alternating user / assistant messages); a base
model (no chat template) and ``raw`` items get ``/v1/completions`` with the same conversation as text.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from workload_shapes import Item, Workload

_CLIENT: httpx.Client | None = None
_CLIENT_LOCK = threading.Lock()


def http_client() -> httpx.Client:
    """One pooled client for every request of the process (thread-safe): a new ``httpx.Client`` costs
    ~50 ms here (its TLS context), which a per-request client would add to every timed first token."""
    global _CLIENT
    with _CLIENT_LOCK:
        if _CLIENT is None:
            # a new connection per request (no keep-alive: llama-server drops idle ones under a client)
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
            _CLIENT = httpx.Client(timeout=900, limits=limits)
        return _CLIENT


@dataclass(frozen=True)
class Sent:
    """One request's outcome: what the server reported and what the client timed (seconds from the
    workload's start)."""

    body: dict
    answer: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    sent_s: float
    done_s: float
    error: str = ""


def body_for(item: Item, answers: list[str], turn: int, chat: bool, model: str) -> dict:
    """The request for ``item``'s ``turn`` after ``answers`` to its earlier turns."""
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": item.max_tokens}
    body["stream_options"] = {"include_usage": True}
    if item.raw:
        return body | {"prompt": item.system}
    if chat:
        messages = [{"role": "system", "content": item.system}]
        for t in range(turn + 1):
            messages.append({"role": "user", "content": item.turns[t]})
            if t < turn:
                messages.append({"role": "assistant", "content": answers[t]})
        return body | {"messages": messages}
    text = item.system
    for t in range(turn + 1):
        text += f"\n\n{item.turns[t]}\nAnswer:" + (answers[t] if t < turn else "")
    return body | {"prompt": text}


def stream(base: str, body: dict, t0: float) -> Sent:
    """POST ``body`` streamed; the first content chunk's time, the answer, the final usage chunk."""
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    sent = time.perf_counter() - t0
    first, parts, usage, timings = None, [], {}, {}
    try:
        with http_client().stream("POST", base + route, json=body) as r:
            if r.status_code >= 400:
                raise RuntimeError(f"{r.status_code}: {r.read().decode(errors='replace')[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                for choice in chunk.get("choices") or []:
                    piece = (
                        choice.get("delta", {}).get("content") if "messages" in body else choice.get("text")
                    )
                    if piece:
                        first = first if first is not None else time.perf_counter() - t0
                        parts.append(piece)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        now = time.perf_counter() - t0
        return Sent(body, "", 0, 0, now - sent, sent, now, error=str(exc)[:300])
    done = time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:  # a server that reports only llama.cpp's timings
        cached = timings.get("cache_n", 0)
    prompt = usage.get("prompt_tokens") or timings.get("prompt_n", 0) + timings.get("cache_n", 0)
    return Sent(
        body, "".join(parts), prompt, cached, (first if first is not None else done) - sent, sent, done
    )


def run_workload(base: str, workload: Workload, chat: bool, model: str) -> tuple[list[Sent], float]:
    """Every request of ``workload`` against ``base``; the requests in send order and the wall time."""
    results: list[Sent] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def conversation(item: Item) -> None:
        answers: list[str] = []
        for turn in range(len(item.turns)):
            sent = stream(base, body_for(item, answers, turn, chat and not item.raw, model), t0)
            with lock:
                results.append(sent)
            answers.append(sent.answer)

    for stage in workload.stages:
        start = time.perf_counter() - t0
        if workload.clients == 0:  # timed: each item at its arrival
            threads = [threading.Timer(max(0.0, start + it.at_s - (time.perf_counter() - t0)), conversation, (it,)) for it in stage]  # fmt: skip
        else:
            queue = list(stage)

            def client(queue: list[Item] = queue) -> None:
                while True:
                    with lock:
                        if not queue:
                            return
                        item = queue.pop(0)
                    conversation(item)

            threads = [threading.Thread(target=client) for _ in range(min(workload.clients, len(stage)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - t0
    return sorted(results, key=lambda s: s.sent_s), wall


Tokenize = Callable[[dict], list[int]]  # a request body -> the prompt ids the server sees


def local_tokenizer(loaded) -> tuple[Tokenize, Callable[[str], list[int]]]:
    """forkline's own tokenizer and chat template (as its HTTP door renders a request)."""

    def prompt_ids(body: dict) -> list[int]:
        if "messages" in body:
            return loaded.tokenizer.encode(loaded.chat.format(body["messages"]), add_special_tokens=False)
        return loaded.tokenizer.encode(body["prompt"], add_special_tokens=True)

    return prompt_ids, lambda text: loaded.tokenizer.encode(text, add_special_tokens=False)


def llama_tokenizer(base: str) -> tuple[Tokenize, Callable[[str], list[int]]]:
    """llama-server's ``/apply-template`` and ``/tokenize``."""

    def post(path: str, body: dict) -> dict:
        return httpx.post(base + path, json=body, timeout=120).json()

    def prompt_ids(body: dict) -> list[int]:
        if "messages" in body:
            text = post("/apply-template", {"messages": body["messages"]})["prompt"]
            return post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
        return post("/tokenize", {"content": body["prompt"], "add_special": True})["tokens"]

    return prompt_ids, lambda text: post("/tokenize", {"content": text, "add_special": False})["tokens"]
