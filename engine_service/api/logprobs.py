"""Log probabilities of generated tokens, as a generation reports them (``GenConfig.top_logprobs``).

Each value is the log-softmax of the model's raw logits at the position that predicted the token:
before temperature, top-k / top-p and any ``json_schema`` mask (as OpenAI documents its ``logprobs``),
so it does not depend on how the token was drawn. The engine thread fills ``id`` and ``logprob``; the
engine's stream adds each token's ``text`` and ``raw`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

MAX_TOP_LOGPROBS = 20  # the most alternatives a generation may ask for per position (OpenAI's bound)


@dataclass(frozen=True)
class LogprobEntry:
    """One token at one position. ``text``: its text (special tokens by name; an incomplete UTF-8
    sequence decodes with U+FFFD); ``raw``: its bytes (special tokens: their name's UTF-8)."""

    id: int
    logprob: float
    text: str = ""
    raw: bytes = b""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's entry and its position's ``top`` most likely tokens (most likely first;
    the generated token may or may not be among them)."""

    chosen: LogprobEntry
    top: tuple[LogprobEntry, ...] = ()

    def spelled(self, spell: Speller) -> TokenLogprob:
        """The same values with every entry's ``text`` / ``raw`` filled by ``spell(id)``."""
        return TokenLogprob(_spelled(self.chosen, spell), tuple(_spelled(e, spell) for e in self.top))


class Speller(Protocol):
    """``spell(token_id) -> (text, raw)`` (see :mod:`engine_service.model.text.token_bytes`)."""

    def __call__(self, token_id: int) -> tuple[str, bytes]: ...


def _spelled(entry: LogprobEntry, spell: Speller) -> LogprobEntry:
    text, raw = spell(entry.id)
    return replace(entry, text=text, raw=raw)
