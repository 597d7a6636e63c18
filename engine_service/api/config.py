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
    """A compiled output constraint (``engine_service.executors.grammar.JsonGrammar``): ``matcher()``
    starts a fresh per-generation matcher that masks the tokens the grammar does not allow."""

    source: str

    def matcher(self) -> Any: ...


@dataclass(frozen=True)
class GenConfig:
    """Per-generation settings. Frozen; every field is checked in ``__post_init__``.

    max_new_tokens: most tokens the generation returns (>= 1). The last returned token is the
        session's *pending* prediction: it is not committed until a later generation feeds it.
    temperature / top_p / top_k: sampling (temperature 0 is greedy; top_k 0 and top_p 1 disable).
    seed: seeds the generation's sampler (0 <= seed < 2**64).
    stop_tokens: a generated stop token ends the generation with finish_reason "stop"; it is returned
        and kept by the session as its pending token. A stop token beats the token budget.
    prefill_chunk: most prompt positions fed to one forward for this generation (>= 1); the runner
        also respects the executor's preferred batch size.
    prefill_breakpoints: absolute session positions (>= 1) at which prefill ends a chunk and emits an update
        with ``breakpoint`` set, so an observer callback can clone exactly there. Stored sorted and
        de-duplicated; positions outside the prefill range are ignored.
    top_logprobs: None (default) reports no log probabilities; 0..20 reports each generated token's
        and that many most likely alternatives at its position (``api.logprobs``; the log-softmax of
        the raw logits, before temperature, filters and masks). Costs nothing when None.
    json_schema: "" (default) or a JSON Schema (text) the output must match: the engine compiles it
        into ``grammar`` (``engine_service.executors.grammar.with_grammar``) and masks every step to the
        tokens that keep the output a valid prefix; once the JSON is complete only the end-of-sequence
        tokens are allowed, so ``stop_tokens`` must hold one of them.
    grammar: the compiled ``json_schema`` (not compared, not sent: the engine sets it). A
        ``json_schema`` without it is refused when the generation starts.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    prefill_chunk: int = 512
    prefill_breakpoints: tuple[int, ...] = ()
    top_logprobs: int | None = None
    json_schema: str = ""
    grammar: TokenGrammar | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        ints = {
            "max_new_tokens": (1, None),
            "top_k": (0, None),
            "seed": (0, _MAX_SEED - 1),
            "prefill_chunk": (1, None),
        }
        for name, (lo, hi) in ints.items():
            object.__setattr__(self, name, checked_int(name, getattr(self, name), lo, hi))
        checked_float("temperature", self.temperature, lo=0)
        checked_float("top_p", self.top_p, lo=0, hi=1, lo_open=True)
        if self.top_logprobs is not None:
            checked_int("top_logprobs", self.top_logprobs, lo=0, hi=MAX_TOP_LOGPROBS)
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
