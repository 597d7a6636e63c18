"""What a generation is fed (ids, text tokenized, a prepared input), checked by ``api.limits`` before any
session is touched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine_service.api.limits import EngineLimits, check_breakpoints, check_nonempty, check_tokens
from engine_service.api.limits import check_fits as limits_check_fits
from engine_service.api.prompts import Encoder, TextPrompt, text_tokens
from engine_service.executors.prepared_input import PreparedInput

if TYPE_CHECKING:
    from engine_service.model.text.chat import ChatFormatter

Input = Sequence[int] | TextPrompt | PreparedInput  # what a caller sends
Fed = list[int] | PreparedInput  # what the runner is given


def fed_input(value: Input, tokenizer: Encoder, chat: ChatFormatter | None, vocab_size: int) -> Fed:
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
