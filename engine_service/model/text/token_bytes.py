"""Each token's bytes and text, and the llguidance tokenizer built from them, once per tokenizer (bytes
from a decoder llguidance knows, else each token decoded alone; special tokens never match as text)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import llguidance

from engine_service.model.text.tokenizer import Tokenizer

_lock = threading.Lock()
_built: weakref.WeakKeyDictionary[Tokenizer, TokenBytes] = weakref.WeakKeyDictionary()


class _PerToken:
    """What ``llguidance.TokenizerWrapper`` reads: every token's bytes, EOS / BOS, an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        special = tokenizer.special_ids
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [
            _special_bytes(tokenizer, t) if t in special else tokenizer.decode([t]).encode()
            for t in range(vocab_size)
        ]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


def _special_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    return (tokenizer.id_to_token(token_id) or "").encode()


class TokenBytes:
    """``spell(id) -> (text, raw)`` and :attr:`ll` (the ``llguidance.LLTokenizer``); see :func:`token_bytes`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        vocab = tokenizer.vocab_size
        eos = list(tokenizer.eos_token_ids) or None
        try:
            self.ll: Any = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab, eos_token=eos)
        except ValueError:  # a decoder llguidance does not read
            wrapper = llguidance.TokenizerWrapper(_PerToken(tokenizer, vocab))
            self.ll = llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=eos)
        self._tokenizer = tokenizer
        self._special = tokenizer.special_ids

    def spell(self, token_id: int) -> tuple[str, bytes]:
        """The token's text and raw bytes."""
        if token_id in self._special:
            name = self._tokenizer.id_to_token(token_id) or ""
            return name, name.encode()
        raw = bytes(self.ll.decode_bytes([token_id]))
        return raw.decode("utf-8", errors="replace"), raw


def token_bytes(tokenizer: Tokenizer) -> TokenBytes:
    """The :class:`TokenBytes` of ``tokenizer``, built once (~0.3 s for 49k tokens) and kept with it."""
    with _lock:
        built = _built.get(tokenizer)
        if built is None:
            built = _built[tokenizer] = TokenBytes(tokenizer)
        return built
