"""The tokenizer, built with ``tokenizers`` from GGUF metadata (``gpt2`` byte-level BPE or ``llama``
SentencePiece) or a tokenizer.json, following llama.cpp's token types (control and unknown special,
user-defined matched, unused never). Spec: docs/MODELS.md (Tokenizers)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine_service.api.errors import ModelLoadError
from engine_service.api.limits import check_tokens
from engine_service.model.text.chunked_encoding import ChunkedEncoder, PieceCache, piece_cut
from engine_service.model.text.spm_tokenizer import build_spm_backend, spm_vocab

# GGUF token_type values (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED = 1, 2, 3, 4, 5

# Pre-tokenizer splits by GGUF ``tokenizer.ggml.pre``; each ends in byte-level BPE without a prefix space.
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer | None:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # SmolLM / SmolLM2: every digit on its own, then GPT-2 byte-level splitting
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
            ]
        )
    return None


class Tokenizer:
    """Text <-> token ids; ``encode(text, add_special_tokens=True)`` prepends BOS when the model asks;
    special texts in the text always map to their ids."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool = False,
        hidden_ids: Iterable[int] = (),
        piece_cut: re.Pattern[str] | None = None,
        space_prefix: bool = False,
    ) -> None:
        self._tok = backend
        self._cut, self._space_prefix = piece_cut, space_prefix  # a piece after a cut starts with " "
        self._pieces = PieceCache() if piece_cut is not None else None
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos and bos_token_id is not None
        self._special = frozenset(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._hidden = frozenset(int(t) for t in hidden_ids)  # decoded as nothing (GGUF unused tokens)
        # counted once: with added tokens tokenizers recounts them per call (~0.3 ms for Gemma's 6k)
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers`` tokenizer underneath (read-only use: token bytes for masks)."""
        return self._tok

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._with_bos(self._tok.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def scoped(self, owner: str) -> Tokenizer | ChunkedEncoder:
        """An ``encode`` as this one through ``owner``'s cache of text pieces (``chunked_encoding.py``),
        or this tokenizer where its texts are not cut."""
        if self._pieces is None or self._cut is None:
            return self
        return ChunkedEncoder(self._piece_ids, self._cut, self._pieces, owner, self._with_bos)

    def piece_counts(self) -> tuple[int, int]:
        """Characters of text answered from the piece caches and tokenized (0, 0: texts are not cut)."""
        pieces = self._pieces
        return (0, 0) if pieces is None else (pieces.reused_chars, pieces.tokenized_chars)

    def _piece_ids(self, piece: str, first: bool) -> list[int]:
        if not first and self._space_prefix:  # the normalizer puts back the space as the prefix
            piece = piece[1:]
        return self._tok.encode(piece, add_special_tokens=False).ids

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        check_tokens(ids, self._vocab_size, "ids")
        hidden = self._hidden
        ids = [int(t) for t in ids if not hidden or int(t) not in hidden]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def vocab_digest_source(self) -> bytes:
        """A stable serialisation of the vocabulary and specials (for model fingerprints)."""
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return json.dumps([vocab, self.bos_token_id, self.eos_token_ids, self.add_bos]).encode()


def tokenizer_from_gguf(path: str, meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer ``tokenizer.ggml.*`` describes (``gpt2`` or ``llama``)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(
            path,
            f"unsupported tokenizer model {kind!r} (supported: gpt2 byte-level BPE, llama SentencePiece)",
        )
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(path, "tokenizer.ggml.tokens missing or not a list of strings")
    types = _per_token(path, meta, "tokenizer.ggml.token_type", len(tokens), int) or [_NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_backend(path, meta, tokens)
    else:
        scores = _per_token(path, meta, "tokenizer.ggml.scores", len(tokens), (int, float))
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        backend = build_spm_backend(
            spm_vocab(tokens),
            scores,
            # llama.cpp: true for SentencePiece unless the file says otherwise
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None,
            never_merged={i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL, _USER_DEFINED)},
        )
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _UNKNOWN) and tokens[i]
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _USER_DEFINED and tokens[i]
    ]
    backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    space_prefix = kind == "llama" and bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    return Tokenizer(
        backend,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        hidden_ids=[i for i, t in enumerate(types) if t == _UNUSED],
        # SentencePiece BPE has no pre-tokenizer: long texts are cut where no merge can cross
        piece_cut=piece_cut(tokens, [t.content for t in special + user]) if kind == "llama" else None,
        space_prefix=space_prefix,
    )


def _per_token(
    path: str, meta: dict[str, Any], key: str, n: int, kind: type | tuple[type, ...]
) -> list | None:
    """An optional per-token list (``token_type``, ``scores``): None when absent, checked otherwise."""
    values = meta.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) < n or not all(isinstance(v, kind) for v in values[:n]):
        raise ModelLoadError(path, f"{key} must be a list of {n} numbers, one per token")
    return values[:n]


def _byte_level_backend(path: str, meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError(path, "tokenizer.ggml.tokens / tokenizer.ggml.merges missing")
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = _pre_tokenizer(pre_name)
    if pre is None:
        raise ModelLoadError(
            path, f"unsupported pre-tokenizer {pre_name!r} (supported: smollm, gpt2, llama-bpe)"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelLoadError(path, f"malformed merge {m!r}")
        pairs.append((left, right))
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    # A byte with no token of its own (SmolLM2 lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d) is dropped by
    # both, but llama.cpp drops it after merging, so its neighbours cannot merge across it, while the
    # BPE model drops it first: isolating it as its own piece keeps the neighbours apart.
    missing = "".join(sorted(c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab))
    if missing:
        isolate = pre_tokenizers.Split(Regex("[" + re.escape(missing) + "]"), behavior="isolated")
        pre = pre_tokenizers.Sequence([pre, isolate])
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    return backend


def tokenizer_from_file(
    path: str,
    *,
    bos_token_id: int | None = None,
    eos_token_ids: Sequence[int] = (),
    add_bos: bool | None = None,
) -> Tokenizer:
    """A tokenizer.json (Hugging Face format); a tokenizer_config.json next to it fills in BOS/EOS."""
    try:
        backend = HFTokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on bad files
        raise ModelLoadError(path, f"cannot read tokenizer: {exc}") from None
    cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    cfg = {}
    if os.path.exists(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(cfg_path, f"cannot read: {exc}") from None

    def token_id(entry: Any) -> int | None:
        text = entry.get("content") if isinstance(entry, dict) else entry
        return backend.token_to_id(text) if isinstance(text, str) else None

    if bos_token_id is None:
        bos_token_id = token_id(cfg.get("bos_token"))
    eos = list(eos_token_ids)
    if not eos and (eos_id := token_id(cfg.get("eos_token"))) is not None:
        eos = [eos_id]
    if add_bos is None:
        add_bos = bool(cfg.get("add_bos_token", False))
    return Tokenizer(backend, bos_token_id=bos_token_id, eos_token_ids=eos, add_bos=add_bos)
