"""A prompt as text and the engine's rules for it: the conversation it renders, its tokenization through
the chat template, and where its messages end."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine_service.api.errors import InvalidArgument

MAX_MESSAGE_ENDS = 64  # a Tokenize asks for at most this many message ends (each is one render)


class Encoder(Protocol):  # the engine's Tokenizer
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


class ChatTemplate(Protocol):  # the engine's ChatFormatter; InvalidArgument when it cannot render
    def format(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class TextPrompt:
    """Plain ``text`` (with the tokenizer's special tokens when ``add_special_tokens``), or with
    ``chat`` the chat template's rendering of [``system``] + user ``text`` -- or, when ``messages``
    holds (role, content) pairs, of that whole conversation -- with the generation prompt."""

    text: str
    chat: bool = False
    system: str = ""
    add_special_tokens: bool = False
    messages: tuple[tuple[str, str], ...] = ()

    def conversation(self) -> tuple[tuple[str, str], ...]:
        """The (role, content) messages a chat prompt renders ((): not a chat prompt). The one
        conversation rule: ``messages`` when given, else [``system``] + user ``text``."""
        if not self.chat:
            return ()
        if self.messages:
            return tuple(self.messages)
        return ((("system", self.system),) if self.system else ()) + (("user", self.text),)


@dataclass(frozen=True)
class Tokenized:
    """A text prompt's ``ids`` and, for a chat prompt when asked, ``message_ends``: ascending positions
    in (0, len(ids)) where one of its latest messages (the last excepted) ends."""

    ids: tuple[int, ...]
    message_ends: tuple[int, ...] = ()


def text_tokens(prompt: TextPrompt, tokenizer: Encoder, chat: ChatTemplate | None) -> list[int]:
    """``prompt``'s token ids: the chat template's rendering of its conversation (with the generation
    prompt), or its text; InvalidArgument naming the field for a prompt the rules refuse."""
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
    prompt: TextPrompt, ids: Sequence[int], tokenizer: Encoder, chat: ChatTemplate | None, most: int
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


def _rendered(messages: Sequence[tuple[str, str]], tokenizer: Encoder, chat: ChatTemplate) -> list[int]:
    text = chat.format([{"role": role, "content": content} for role, content in messages])
    return list(tokenizer.encode(text, add_special_tokens=False))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
