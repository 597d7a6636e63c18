"""Structured output: a JSON Schema compiled once per request (llguidance) into a per-step allowed-token
mask; once the JSON is complete only end-of-sequence tokens are allowed. Spec: docs/HTTP.md."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidJsonSchema
from engine_service.model.text.token_bytes import token_bytes
from engine_service.model.text.tokenizer import Tokenizer

# whitespace between JSON tokens as the compact separators json.dumps writes (", " and ": "), so a model
# cannot pad its answer with newlines until the token budget ends
_COMPILE_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def schema_problem(schema: object) -> str | None:
    """Why llguidance cannot compile ``schema`` (a JSON value), or None; needs no tokenizer."""
    if not isinstance(schema, (dict, bool)):
        return f"a JSON Schema must be an object or a boolean, got {type(schema).__name__}"
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPILE_OPTIONS)
    except ValueError as exc:
        return str(exc)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if failed and messages else ("invalid schema" if failed else None)


class GrammarMatcher:
    """One generation's position in the grammar (engine thread only)."""

    __slots__ = ("_m", "_vocab", "_eos")

    def __init__(self, matcher: Any, vocab_size: int, eos: list[int]) -> None:
        self._m = matcher
        self._vocab = vocab_size
        self._eos = eos

    def mask(self, vocab: int) -> mx.array:
        """bool [vocab]: the tokens allowed next (padding rows never); in error, the end-of-sequence tokens."""
        return mx.array(self._allowed(vocab))

    def _allowed(self, vocab: int) -> np.ndarray:
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        allowed = np.zeros(vocab, dtype=np.bool_)
        n = min(vocab, self._vocab)
        allowed[:n] = np.unpackbits(bits, bitorder="little")[:n]
        if not allowed.any():
            allowed[[t for t in self._eos if t < vocab]] = True
        return allowed

    def draft_masks(self, drafts: tuple[int, ...], vocab: int) -> tuple[tuple[int, ...], mx.array]:
        """(the longest prefix of ``drafts`` the grammar allows, bool [1 + len, vocab]: the mask now and
        after each of those drafts); the matcher is left where it was."""
        drafts = drafts[: self._m.validate_tokens(list(drafts))]
        masks = [self._allowed(vocab)]
        for token in drafts:
            self._m.consume_token(int(token))
            masks.append(self._allowed(vocab))
        if drafts:
            self._m.rollback(len(drafts))
        return drafts, mx.array(np.stack(masks))

    def consume(self, token: int) -> None:
        """The token drawn under the last mask (a rejected token puts the matcher in error)."""
        self._m.consume_token(int(token))

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


@dataclasses.dataclass(frozen=True)
class JsonGrammar:
    """A compiled JSON Schema for one tokenizer (``GenConfig.grammar``). ``source``: the schema text."""

    source: str
    grammar: str
    ll_tokenizer: Any = dataclasses.field(repr=False, compare=False)

    def matcher(self) -> GrammarMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar, log_level=0)
        if matcher.is_error():  # compiled and validated already: only a resource limit gets here
            raise InvalidJsonSchema(f"json_schema: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.ll_tokenizer.vocab_size, list(self.ll_tokenizer.eos_tokens))


def compile_json_schema(source: str, tokenizer: Tokenizer) -> JsonGrammar:
    """``source`` (JSON Schema text) compiled for ``tokenizer``; InvalidJsonSchema naming the problem."""
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidJsonSchema(f"json_schema is not JSON: {exc}") from None
    problem = schema_problem(schema)
    if problem is not None:
        raise InvalidJsonSchema(f"json_schema: {problem}")
    ll = token_bytes(tokenizer).ll
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPILE_OPTIONS)
    return JsonGrammar(source, grammar, ll)


def with_grammar(config: GenConfig, tokenizer: Tokenizer) -> GenConfig:
    """``config`` with its ``json_schema`` compiled into ``grammar`` (unchanged without a schema)."""
    if not config.json_schema or config.grammar is not None:
        return config
    return dataclasses.replace(config, grammar=compile_json_schema(config.json_schema, tokenizer))
