"""Generated tokens cached, through the HTTP door on the packaged models (slow): a follow-up turn
reports as cached exactly the longest common prefix of its tokens with the previous turn's prompt plus
its committed answer ids (computed here from token ids), and answers as a cold run over the same
tokens; with --no-cache_generated (negative control) only the previous prompt is cached. SmolLM2
through chat, Gemma 3 (a base model) through completions with a first prompt past its sliding window;
both cache kinds."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import openai
import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.prompts import TextPrompt, text_tokens
from engine_service.api.stream_events import Tokens
from engine_service.executors.options import ExecutorSettings
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.rpc.server import create_server as create_prefix_server
from tests.service.conftest import Prefix

pytestmark = pytest.mark.slow

KINDS = ("batched-sequence", "batched-cell")
ANSWER_TOKENS = 12
FOLLOW_TOKENS = 8


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma-3-270m"])
def loaded(request):
    from engine_service.api.errors import ModelLoadError
    from engine_service.model.loading.loader import load_model

    try:
        return load_model(request.param)
    except ModelLoadError as exc:
        pytest.skip(f"{request.param} unavailable: {exc}")


@contextmanager
def engine(loaded, kind: str) -> Iterator[tuple[EngineSessions, str]]:
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name="m",
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=16, max_session_tokens=2048, cache_kind=kind),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    try:
        yield deps, f"127.0.0.1:{port}"
    finally:
        server.stop(0, shutdown_runner=True)


@contextmanager
def door(address: str, cache_generated: bool) -> Iterator[openai.OpenAI]:
    gateway, channel = connect_engine(address, max_entries=32, cache_generated=cache_generated)
    server, bound = create_prefix_server(gateway, "127.0.0.1:0", channel=channel)
    prefix = Prefix(server, bound)
    try:
        http = server.start_http("127.0.0.1", 0, model_name="m")
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="x", max_retries=0, timeout=300)
    finally:
        prefix.stop(0)  # releases its snapshots: the next door starts from an empty cache


def common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cold(deps: EngineSessions, loaded, tokens: list[int], n: int, ignore_eos: bool = False) -> list[int]:
    stops = () if ignore_eos else tuple(loaded.tokenizer.eos_token_ids)
    config = GenConfig(max_new_tokens=n, stop_tokens=stops)
    with deps.runner.open_session() as session:
        return list(session.generate_async(tokens, config).wait(300).tokens)


class Conversation:
    """Two turns of one model's door: chat where the model has a template, else completions."""

    def __init__(self, loaded) -> None:
        self.loaded = loaded
        self.chat = loaded.chat is not None and loaded.chat.available

    def first(self) -> TextPrompt:
        if self.chat:
            return TextPrompt(
                "", chat=True, messages=(("user", "Name three colors and say why you like them."),)
            )
        story = " ".join(f"Room {i} has a {('red', 'blue', 'green')[i % 3]} door." for i in range(90))
        return TextPrompt(story + " The door of room 90 is", add_special_tokens=True)

    def second(self, first: TextPrompt, answer: str) -> TextPrompt:
        if self.chat:
            return TextPrompt(
                "", chat=True, messages=(*first.messages, ("assistant", answer), ("user", "Why?"))
            )
        return TextPrompt(first.text + answer + " The door of room 91 is", add_special_tokens=True)

    def text(self, ids: list[int]) -> str:
        return self.loaded.tokenizer.decode(ids, skip_special_tokens=True)

    def tokens(self, prompt: TextPrompt) -> list[int]:
        return text_tokens(prompt, self.loaded.tokenizer, self.loaded.chat)

    def ask(self, client: openai.OpenAI, prompt: TextPrompt, n: int) -> tuple[str, int, int]:
        """(text, prompt tokens, cached tokens) of a greedy answer of at most ``n`` tokens."""
        if self.chat:
            messages = [{"role": r, "content": c} for r, c in prompt.messages]
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0)
            text = reply.choices[0].message.content
        else:
            reply = client.completions.create(model="m", prompt=prompt.text, max_tokens=n, temperature=0)
            text = reply.choices[0].text
        usage = reply.usage
        return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_a_follow_up_turn_reuses_the_answer_and_answers_as_a_cold_run(loaded, kind) -> None:
    talk = Conversation(loaded)
    first = talk.first()
    p1 = talk.tokens(first)
    with engine(loaded, kind) as (deps, address):
        g1 = cold(deps, loaded, p1, ANSWER_TOKENS)  # what the door generates (greedy), computed cold
        cached: dict[bool, int] = {}
        for flag in (False, True):  # the negative control first, each on an empty cache
            with door(address, cache_generated=flag) as client:
                answer, prompt_tokens, _ = talk.ask(client, first, ANSWER_TOKENS)
                assert prompt_tokens == len(p1)
                assert answer == talk.text(g1)
                second = talk.second(first, answer)
                p2 = talk.tokens(second)
                text, prompt_tokens, cached[flag] = talk.ask(client, second, FOLLOW_TOKENS)
                assert prompt_tokens == len(p2)
                g2 = cold(deps, loaded, p2, FOLLOW_TOKENS)
                assert text == talk.text(g2)
                if flag:  # a branch inside the stored answer (an edited turn): reused up to where it
                    # diverges, a clone below the stored entry's end (Gemma's rings: within their rewind)
                    branch = talk.second(first, answer[: len(answer) // 2])
                    p3 = talk.tokens(branch)
                    text, _, branched = talk.ask(client, branch, FOLLOW_TOKENS)
                    assert text == talk.text(cold(deps, loaded, p3, FOLLOW_TOKENS))
    stored = p1 + g1[:-1]  # the answer's last token is pending: never written, never stored
    expected = min(common(p2, stored), len(p2) - 1)
    assert expected > len(p1) + ANSWER_TOKENS // 2  # the answer re-tokenizes alike, mostly: not vacuous
    assert cached[True] == expected
    assert cached[False] == min(common(p2, p1), len(p2) - 1) < expected
    keys = (p1, stored, p2, p2 + g2[:-1])  # every entry the cache holds by then
    assert branched == min(max(common(p3, key) for key in keys), len(p3) - 1)
    assert len(p1) < branched < len(stored)  # inside the answer: not vacuous


def test_a_call_its_client_leaves_stores_only_exact_snapshots(loaded) -> None:
    """The gateway stops the generation mid-way and drains the engine stream: what it stores is
    the prompt, and perhaps the session at its last committed token -- each a prefix of the cold run."""
    talk = Conversation(loaded)
    p1 = talk.tokens(talk.first())
    with engine(loaded, "batched-sequence") as (deps, address):
        gateway, channel = connect_engine(address, max_entries=32)
        try:
            config = GenConfig(max_new_tokens=400)
            stream = gateway.generate(GatewayRequest("ns", p1, config, ignore_eos=True), CallContext("alice"))
            events, seen = iter(stream), 0
            while seen < 5:
                event = next(events)
                seen += len(event.ids) if isinstance(event, Tokens) else 0
            stream.stop()
            events.close()  # the drain stores what the engine still sends
            reference = p1 + cold(deps, loaded, p1, 400, ignore_eos=True)
            keys = [entry.tokens for entry in gateway.entries("ns")]
            assert tuple(p1) in keys
            for key in keys:
                assert list(key) == reference[: len(key)]
                assert len(key) < len(reference) - 1  # stopped mid-way: not the whole answer
        finally:
            gateway.clear()
            channel.close()
