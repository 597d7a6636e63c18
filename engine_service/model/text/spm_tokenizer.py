"""The GGUF ``llama`` tokenizer (SentencePiece BPE) as llama.cpp runs it, built with ``tokenizers``: every
way of writing a token as two tokens is a merge ranked by the merged token's score, with byte
fallback and no pre-tokenizer. Spec: docs/MODELS.md (Tokenizers and agreement with llama.cpp)."""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

log = logging.getLogger(__name__)

SPACE = "\u2581"


def spm_vocab(tokens: Sequence[str]) -> dict[str, int]:
    """Token text -> id as llama.cpp keys it (a duplicate maps to its last id; empty -> ``[EMPTY_<id>]``)."""
    return {tok or f"[EMPTY_{i}]": i for i, tok in enumerate(tokens)}


def spm_merges(
    vocab: dict[str, int], scores: Sequence[float] | None, never_merged: Container[int] = ()
) -> tuple[list[tuple[str, str]], int]:
    """Every pair whose concatenation is a token (not ``never_merged``), highest score first (ties: lower id,
    then shorter left part), and how many merge results share their score."""
    # one pass over every split point of every token (~1.2M for a 262k vocabulary, ~1 s); the
    # comprehension is about twice as fast as the same loop written out
    found = [
        (i, k)
        for tok, i in vocab.items()
        if i not in never_merged
        for k in range(1, len(tok))
        if tok[:k] in vocab and tok[k:] in vocab
    ]
    if scores is None:
        found.sort()
        targets = {i for i, _ in found}
        tied = len(targets) if len(targets) > 1 else 0
    else:
        found.sort(key=lambda ik: (-scores[ik[0]], ik[0], ik[1]))
        targets = {i for i, _ in found}
        tied = len(targets) - len({scores[i] for i in targets})
    text = {i: tok for tok, i in vocab.items()}
    return [(text[i][:k], text[i][k:]) for i, k in found], tied


def build_spm_backend(
    vocab: dict[str, int],
    scores: Sequence[float] | None,
    *,
    add_space_prefix: bool,
    unk_token: str | None,
    never_merged: Container[int] = (),
) -> HFTokenizer:
    """The ``tokenizers`` model, normalizer and decoder (added tokens are the caller's: ``never_merged``)."""
    merges, tied = spm_merges(vocab, scores, never_merged)
    if tied:
        log.warning(
            "SentencePiece vocabulary: %d merge results share their score with another; where two such "
            "merges compete the ids can differ from llama.cpp's (it takes the leftmost)",
            tied,
        )
    byte_tokens = all(f"<0x{b:02X}>" in vocab for b in range(256))
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        unk_token=unk_token if unk_token in vocab else None,
        fuse_unk=False,
        byte_fallback=byte_tokens,
    )
    backend = HFTokenizer(bpe)
    # llama.cpp puts the prefix space in front of every piece of text that starts the input or follows
    # a special / user-defined token; the normalizer runs on exactly those pieces.
    steps = [normalizers.Replace(" ", SPACE)]
    if add_space_prefix:
        steps.append(normalizers.Prepend(SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    return backend
