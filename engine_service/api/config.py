"""GenConfig: how one generation samples, stops and chunks its prefill."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine_service.api.checks import checked_float, checked_int
from engine_service.api.errors import InvalidArgument
from engine_service.api.logprobs import MAX_TOP_LOGPROBS

_MAX_SEED = 2**64


def int_tuple(name: str, values: object) -> tuple[int, ...]:
    """``values`` copied into a tuple of plain ints (bools refused); InvalidArgument naming ``name`` otherwise."""
    try:
        items = tuple(values) if isinstance(values, Iterable) else None
    except TypeError:  # an iterator that fails part way
        items = None
    if items is None:
        raise InvalidArgument(f"{name} must be a sequence of ints, got {values!r}")
    out = []
    for v in items:
        if isinstance(v, bool):
            raise InvalidArgument(f"{name} must hold ints, got {v!r}")
        try:
            out.append(operator.index(v))
        except TypeError as exc:
            raise InvalidArgument(f"{name} must hold ints, got {v!r}") from exc
    return tuple(out)


class TokenGrammar(Protocol):
    """A compiled output constraint; ``matcher()`` starts a fresh per-generation token mask."""

    source: str

    def matcher(self) -> Any: ...


SPECULATIVE_REQUESTS = ("", "off")  # GenConfig.speculative: the engine's mode, or none


@dataclass(frozen=True)
class GenConfig:
    """Per-generation settings, checked in ``__post_init__``. The last returned token is the session's
    pending prediction, committed when a later generation feeds it."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int = 0  # [0, 2**64)
    stop_tokens: tuple[int, ...] = ()  # ends with "stop" (before the budget); kept as the pending token
    prefill_chunk: int = 512  # prompt positions one forward feeds this generation at most
    # absolute positions where prefill ends a chunk and reports ``breakpoint`` (a callback can clone
    # exactly there); stored sorted, de-duplicated; those outside the prefill are ignored
    prefill_breakpoints: tuple[int, ...] = ()
    # None: no log probabilities; 0..20: each token's and that many alternatives (raw logits' log-softmax)
    top_logprobs: int | None = None
    # a JSON Schema the output must match; once complete only EOS is allowed, so stop_tokens holds one
    json_schema: str = ""
    # a resume: the input's last N tokens were drawn by an earlier attempt of this generation (on an
    # engine that failed); sampling starts N draws on and a grammar consumes them, so the continuation
    # equals the uninterrupted run. At most the session's positions + its input (the engine checks)
    drawn_tokens: int = 0
    # speculative decoding for this generation: "" the engine's --speculative, "off" none; the output
    # is the same either way (drafts are verified exactly), only its speed differs
    speculative: str = ""
    # whose earlier texts may draft for it (the engine sets the caller's owner id; never on the wire)
    draft_scope: str = field(default="", compare=False, repr=False)
    # the compiled json_schema (the engine sets it; without it a json_schema is refused at start)
    grammar: TokenGrammar | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        ints = {
            "max_new_tokens": (1, None),
            "top_k": (0, None),
            "seed": (0, _MAX_SEED - 1),
            "prefill_chunk": (1, None),
            "drawn_tokens": (0, None),
        }
        for name, (lo, hi) in ints.items():
            object.__setattr__(self, name, checked_int(name, getattr(self, name), lo, hi))
        checked_float("temperature", self.temperature, lo=0)
        checked_float("top_p", self.top_p, lo=0, hi=1, lo_open=True)
        if self.top_logprobs is not None:
            checked_int("top_logprobs", self.top_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
        if self.speculative not in SPECULATIVE_REQUESTS:
            raise InvalidArgument(
                f"speculative must be one of {', '.join(map(repr, SPECULATIVE_REQUESTS))}, got {self.speculative!r}"
            )
        if not isinstance(self.json_schema, str):
            raise InvalidArgument(f"json_schema must be a string, got {type(self.json_schema).__name__}")
        if self.grammar is not None and self.grammar.source != self.json_schema:
            raise InvalidArgument("grammar must be the compiled json_schema")
        stops = int_tuple("stop_tokens", self.stop_tokens)
        if any(t < 0 for t in stops):
            raise InvalidArgument(f"stop_tokens must be >= 0, got {stops}")
        breakpoints = int_tuple("prefill_breakpoints", self.prefill_breakpoints)
        if any(b < 1 for b in breakpoints):
            raise InvalidArgument(f"prefill_breakpoints must be >= 1, got {breakpoints}")
        # Frozen dataclass: normalise through object.__setattr__ (lists in, tuples stored).
        object.__setattr__(self, "stop_tokens", stops)
        object.__setattr__(self, "prefill_breakpoints", tuple(sorted(set(breakpoints))))
