"""Incremental detokenization: each step decodes a short window of recent tokens without and with the new
ones and emits the difference once it ends in a complete character; the deltas join to ``decode(all)``."""

from __future__ import annotations

from collections.abc import Iterable

from engine_service.model.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class StreamDecoder:
    """``push(token) -> str`` returns newly completed text (possibly ""); ``flush()`` returns the rest."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window re-decoded each step
        self._read = 0  # tokens whose text has been emitted

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        return self._emit(final=False)

    def push_many(self, tokens: Iterable[int]) -> str:
        return "".join(self.push(t) for t in tokens)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(after) <= len(before) or (after.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
