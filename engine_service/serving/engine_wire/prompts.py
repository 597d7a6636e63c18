"""``TextPrompt`` <-> ``TextInput``, ``Tokenized`` <-> ``TokenizeResponse``, and a prompt as the
``tokens`` / ``text`` input of a request."""

from __future__ import annotations

from collections.abc import Sequence

from engine_service.api.prompts import TextPrompt, Tokenized
from protos import engine_pb2 as pb

Prompt = Sequence[int] | TextPrompt  # token ids, or text the engine tokenizes


def text_prompt(msg: pb.TextInput) -> TextPrompt:
    messages = tuple((m.role, m.content) for m in msg.messages)
    return TextPrompt(msg.text, msg.chat, msg.system, msg.add_special_tokens, messages)


def text_input(text: TextPrompt) -> pb.TextInput:
    return pb.TextInput(
        text=text.text,
        chat=text.chat,
        system=text.system,
        add_special_tokens=text.add_special_tokens,
        messages=[pb.ChatMessage(role=role, content=content) for role, content in text.messages],
    )


def prompt_fields(prompt: Prompt) -> dict[str, pb.TokenIds | pb.TextInput]:
    """The ``input`` oneof (``tokens`` or ``text``) of a Generate, Lookup or gateway Generate request."""
    if isinstance(prompt, TextPrompt):
        return {"text": text_input(prompt)}
    return {"tokens": pb.TokenIds(ids=list(prompt))}


def tokenize_request(
    text: TextPrompt, message_ends: int = 0, cache_scope: str | None = None
) -> pb.TokenizeRequest:
    request = pb.TokenizeRequest(text=text_input(text), message_ends=message_ends)
    if cache_scope is not None:
        request.cache_scope = cache_scope
    return request


def tokenize_response(tokenized: Tokenized) -> pb.TokenizeResponse:
    return pb.TokenizeResponse(ids=tokenized.ids, message_ends=tokenized.message_ends)


def tokenized(msg: pb.TokenizeResponse) -> Tokenized:
    return Tokenized(tuple(msg.ids), tuple(msg.message_ends))
