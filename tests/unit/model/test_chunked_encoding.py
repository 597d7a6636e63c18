"""Chunked encoding (``chunked_encoding.py``): a text's ids by pieces equal its ids whole, on a small
SentencePiece vocabulary with a token that joins a word to the next (``x▁y``), space-run added tokens
(as Gemma's) and control tokens; the cache is per owner and bounded."""

from __future__ import annotations

import random
import re
from array import array

import pytest

from engine_service.model.text import chunked_encoding
from engine_service.model.text import tokenizer as tokenizer_module
from engine_service.model.text.chunked_encoding import PieceCache, cuts, piece_cut
from engine_service.model.text.tokenizer import tokenizer_from_gguf

S = chunked_encoding.SPACE
BYTES = [f"<0x{b:02X}>" for b in range(256)]
NORMAL = [
    "a",
    "b",
    "x",
    "y",
    ">",
    "<",
    S,
    "ab",
    S + "a",
    S + "ab",
    S + S,
    "x" + S,
    "x" + S + "y",
    "y" + S,
    S + "b",
]
ADDED = ["<s>", "</s>", "<t>", "  ", "   "]  # two control tokens, one control tag, two space runs
TYPES = [6] * 256 + [1] * len(NORMAL) + [3, 3, 3, 4, 4]


def _tokenizer(space_prefix: bool = True):
    tokens = BYTES + NORMAL + ADDED
    scores = [0.0] * 256 + [float(-len(t)) + i * 1e-3 for i, t in enumerate(NORMAL)] + [0.0] * len(ADDED)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": TYPES,
        "tokenizer.ggml.bos_token_id": len(tokens) - 5,
        "tokenizer.ggml.add_space_prefix": space_prefix,
    }
    return tokenizer_from_gguf("tiny.gguf", meta)


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    parts = ["a", "b", "x", "y", "ab", " ", "  ", "   ", "x y", ">", "> <", "<s>", "<t>", "\n", "é", S, " x"]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def test_cut_rule_from_the_vocabulary():
    cut = piece_cut(NORMAL, ["<s>", "<t>", "  "])
    # "x" and "y" join a following ▁ (x▁y, y▁), ">" ends an added token, "<" starts one, a space
    # next to another could be an added token's
    assert [m.start() for m in cut.finditer("a b x y a> b a <s b  a b")] == [1, 3, 12, 17, 22]
    assert piece_cut(NORMAL, ["<a b>"]) is None  # an added token with a space could span any cut
    assert cuts("ab ab ab ab", cut, stride=3) == [5, 8]  # each cut at least 3 after the last


@pytest.mark.parametrize("space_prefix", [True, False])
@pytest.mark.parametrize("stride", [1, 3, 512])
def test_pieces_join_to_the_whole_text_ids(monkeypatch, space_prefix, stride):
    tok = _tokenizer(space_prefix)
    monkeypatch.setattr(chunked_encoding, "STRIDE", stride)
    texts = _texts(400)
    scoped = tok.scoped("owner")
    assert scoped is not tok
    assert [t for t in texts if scoped.encode(t, True) != tok.encode(t, True)] == []
    # a second pass answers from the cache: the same ids
    assert [t for t in texts if scoped.encode(t) != tok.encode(t)] == []


def test_negative_control_cutting_at_every_space_changes_ids(monkeypatch):
    """The rule matters: cut before any space and ``x▁y`` / the space runs split wrongly."""
    monkeypatch.setattr(chunked_encoding, "STRIDE", 1)
    monkeypatch.setattr(tokenizer_module, "piece_cut", lambda vocab, added: re.compile(" (?=.)"))
    tok = _tokenizer()
    wrong = [t for t in _texts(400) if tok.scoped("o").encode(t) != tok.encode(t)]
    assert len(wrong) > 50


def test_cache_is_per_owner_and_bounded():
    cache = PieceCache(owner_chars=80, total_chars=120)
    for i in range(10):
        cache.put("a", (False, f"{i:09d}"), array("i", [i]))
    assert cache.get("b", (False, "000000007")) is None  # one owner never reads another's pieces
    assert cache.get("a", (False, "000000000")) is None and cache.get("a", (False, "000000007")) is not None
    for i in range(10):
        cache.put("b", (False, f"{i:09d}"), array("i", [i]))
    sizes = {o: sum(len(k[1]) for k in p) for o, p in cache._owners.items()}
    assert sizes["b"] <= 80 and sum(sizes.values()) <= 120  # "a", the least recent owner, gave way
    cache.put("a", (True, "x" * 11), array("i", [1]))  # over owner_chars / 8: not kept
    assert cache.get("a", (True, "x" * 11)) is None
