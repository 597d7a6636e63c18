"""Tokenize's message ends (api/prompts.py, answered by the sessions): where each message of a chat
ends in its tokenization, checked against the rendered strings (the char tokenizer: a character is a
token)."""

from __future__ import annotations

import pytest

from engine_service.api import prompts
from engine_service.api.errors import InvalidArgument
from engine_service.api.prompts import TextPrompt
from engine_service.model.text.chat import ChatFormatter

MESSAGES = (("system", "be brief"), ("user", "first question"), ("assistant", "an answer"), ("user", "next"))
CHATML = ChatFormatter(name="chatml")


def agreeing(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def expected_ends(chat: ChatFormatter, messages, most: int) -> tuple[int, ...]:
    """Independent: on the rendered strings, where each shorter conversation stops agreeing."""
    as_dicts = [{"role": r, "content": c} for r, c in messages]
    full = chat.format(as_dicts)
    return tuple(
        sorted(agreeing(chat.format(as_dicts[:n]), full) for n in range(len(messages) - 1, 0, -1)[:most])
    )


@pytest.mark.parametrize("most", [1, 2, 3, 8])
def test_the_latest_message_ends_are_where_the_renderings_stop_agreeing(tokenizer, most) -> None:
    prompt = TextPrompt("", chat=True, messages=MESSAGES)
    ids = prompts.text_tokens(prompt, tokenizer, CHATML)
    ends = prompts.message_ends(prompt, ids, tokenizer, CHATML, most)
    want = expected_ends(CHATML, MESSAGES, most)
    assert ends == want and len(ends) == min(most, len(MESSAGES) - 1)  # never vacuous
    assert all(0 < e < len(ids) for e in ends)


def test_system_and_text_is_a_two_message_conversation(tokenizer) -> None:
    prompt = TextPrompt("next", chat=True, system="be brief")
    ids = prompts.text_tokens(prompt, tokenizer, CHATML)
    assert prompts.message_ends(prompt, ids, tokenizer, CHATML, 8) == expected_ends(
        CHATML, (("system", "be brief"), ("user", "next")), 8
    )


def test_plain_text_and_zero_ask_for_nothing(tokenizer) -> None:
    plain = TextPrompt("no chat here")
    assert (
        prompts.message_ends(plain, prompts.text_tokens(plain, tokenizer, None), tokenizer, CHATML, 8) == ()
    )
    chat = TextPrompt("", chat=True, messages=MESSAGES)
    assert (
        prompts.message_ends(chat, prompts.text_tokens(chat, tokenizer, CHATML), tokenizer, CHATML, 0) == ()
    )


def test_a_template_that_refuses_a_partial_conversation_stops_the_search(tokenizer) -> None:
    strict = ChatFormatter(
        "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('must end with a user turn') }}{% endif %}"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}<assistant>"
    )
    prompt = TextPrompt("", chat=True, messages=MESSAGES)
    ids = prompts.text_tokens(prompt, tokenizer, strict)
    # the 3-message rendering ends with the assistant: refused, so nothing earlier is looked for
    assert prompts.message_ends(prompt, ids, tokenizer, strict, 8) == ()
    loose = ChatFormatter(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}<assistant>"
    )
    assert (
        len(prompts.message_ends(prompt, prompts.text_tokens(prompt, tokenizer, loose), tokenizer, loose, 8))
        == 3
    )


def test_the_sessions_tokenize_answers_ids_and_ends_and_bounds_the_ask(make_sessions) -> None:
    sessions = make_sessions()
    sessions.chat = CHATML
    prompt = TextPrompt("", chat=True, messages=MESSAGES)
    tokenized = sessions.tokenize(prompt, 2)
    assert list(tokenized.ids) == prompts.text_tokens(prompt, sessions.tokenizer, CHATML)
    assert tokenized.message_ends == expected_ends(CHATML, MESSAGES, 2)
    assert sessions.tokenize(prompt).message_ends == ()
    with pytest.raises(InvalidArgument, match="message_ends"):
        sessions.tokenize(prompt, prompts.MAX_MESSAGE_ENDS + 1)
