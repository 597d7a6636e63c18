"""Log probabilities of generated tokens (``GenConfig.top_logprobs``): the raw logits' log-softmax,
before temperature, filters and masks (as OpenAI's ``logprobs``); text and bytes are added by the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

MAX_TOP_LOGPROBS = 20  # the most alternatives a generation may ask for per position (OpenAI's bound)


@dataclass(frozen=True)
class LogprobEntry:
    """One token at one position; special tokens spell their name, a partial UTF-8 sequence U+FFFD."""

    id: int
    logprob: float
    text: str = ""
    raw: bytes = b""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's entry and its position's ``top`` most likely tokens, most likely first."""

    chosen: LogprobEntry
    top: tuple[LogprobEntry, ...] = ()

    def spelled(self, spell: Speller) -> TokenLogprob:
        return TokenLogprob(_spelled(self.chosen, spell), tuple(_spelled(e, spell) for e in self.top))


class Speller(Protocol):
    """``spell(token_id) -> (text, raw)`` (see :mod:`engine_service.model.text.token_bytes`)."""

    def __call__(self, token_id: int) -> tuple[str, bytes]: ...


def _spelled(entry: LogprobEntry, spell: Speller) -> LogprobEntry:
    text, raw = spell(entry.id)
    return replace(entry, text=text, raw=raw)
