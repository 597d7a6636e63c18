"""What a generation is fed (ids, text tokenized, a prepared input), checked by ``api.limits`` before any
session is touched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine_service.api.errors import InvalidArgument
from engine_service.api.limits import EngineLimits, check_breakpoints, check_nonempty, check_tokens
from engine_service.api.limits import check_fits as limits_check_fits
from engine_service.api.prompts import TextPrompt
from engine_service.executors.prepared_input import PreparedInput

if TYPE_CHECKING:
    from engine_service.model.text.chat import ChatFormatter
    from engine_service.model.text.tokenizer import Tokenizer

Input = Sequence[int] | TextPrompt | PreparedInput  # what a caller sends
Fed = list[int] | PreparedInput  # what the runner is given
MAX_MESSAGE_ENDS = 64  # a Tokenize asks for at most this many message ends (each is one render)


def text_tokens(prompt: TextPrompt, tokenizer: Tokenizer, chat: ChatFormatter | None) -> list[int]:
    if prompt.chat:
        if chat is None:
            raise InvalidArgument("text.chat: this model has no chat template")
        if prompt.messages and (prompt.text or prompt.system):
            raise InvalidArgument("text.messages replaces text.text and text.system: send one or the other")
        return _rendered(prompt.conversation(), tokenizer, chat)
    if prompt.system or prompt.messages:
        raise InvalidArgument(
            f"text.{'system' if prompt.system else 'messages'} is only used with text.chat = true"
        )
    return list(tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens))


def message_ends(
    prompt: TextPrompt, ids: Sequence[int], tokenizer: Tokenizer, chat: ChatFormatter | None, most: int
) -> tuple[int, ...]:
    """Where each of the latest ``most`` messages of chat ``prompt`` but the last ends in ``ids`` (its
    tokenization), ascending. Each end is the common prefix of ``ids`` with the conversation rendered up
    to that message (with a generation prompt, as ``ids`` was): a BPE merge across the boundary moves
    it a token earlier, and any position is an exact checkpoint. A template that refuses a partial
    conversation stops the search: no end is wrong, some are missing."""
    messages = prompt.conversation()
    if chat is None or most <= 0:
        return ()
    ends: list[int] = []
    for count in range(len(messages) - 1, max(len(messages) - 1 - most, 0), -1):
        try:
            partial = _rendered(messages[:count], tokenizer, chat)
        except InvalidArgument:
            break
        end = _common_prefix(partial, ids)
        if end <= 0:
            break  # earlier messages share nothing either
        if end < len(ids):
            ends.append(end)
    return tuple(sorted(set(ends)))


def _rendered(messages: Sequence[tuple[str, str]], tokenizer: Tokenizer, chat: ChatFormatter) -> list[int]:
    text = chat.format([{"role": role, "content": content} for role, content in messages])
    return list(tokenizer.encode(text, add_special_tokens=False))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def fed_input(value: Input, tokenizer: Tokenizer, chat: ChatFormatter | None, vocab_size: int) -> Fed:
    """What the runner is fed for ``value``: InvalidArgument when it is empty or a token is unknown."""
    if isinstance(value, PreparedInput):
        return value
    if isinstance(value, TextPrompt):
        ids, which = text_tokens(value, tokenizer, chat), "text"
    else:
        ids, which = check_tokens(value, vocab_size), "tokens"
    check_nonempty(len(ids), f"input.{which}")
    return ids


def input_size(value: Fed) -> int:
    return value.size() if isinstance(value, PreparedInput) else len(value)


def check_fits(start: int, size: int, breakpoints: Sequence[int], limits: EngineLimits) -> None:
    """The input must fit the session and breakpoints must lie inside it: (start, start + size]."""
    limits_check_fits(start, size, limits.max_session_tokens)
    check_breakpoints(start, size, breakpoints)
