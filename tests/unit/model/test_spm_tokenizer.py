"""GGUF SentencePiece tokenizers (tokenizer.ggml.model = "llama") on tiny vocabularies written as GGUF
files: merge order, byte fallback, space prefix, token types and BOS, streaming, bad metadata, and
random vocabularies against the plain-Python llama.cpp loop (tests/model/llamacpp_spm.py)."""

from __future__ import annotations

import random

import pytest

from engine_service.api.errors import ModelLoadError
from engine_service.model.loading.gguf_file import read_metadata
from engine_service.model.text.detokenizer import StreamDecoder
from engine_service.model.text.tokenizer import tokenizer_from_gguf
from tests.model.gguf_writer import write_gguf
from tests.model.llamacpp_spm import SPACE, LlamaCppSpm

BYTES = [f"<0x{b:02X}>" for b in range(256)]
# id: 0 <pad> 1 <eos> 2 <bos> 3 <unk> 4 <ctl> (control) 5 <tag> (user-defined) 6 <unused0> (unused),
# 7..262 bytes, then normal tokens with their scores
HEAD = [("<pad>", 0.0, 3), ("<eos>", 0.0, 3), ("<bos>", 0.0, 3), ("<unk>", 0.0, 2), ("<ctl>", 0.0, 3)]
HEAD += [("<tag>", 0.0, 4), ("<unused0>", 0.0, 5)] + [(b, 0.0, 6) for b in BYTES]
NORMAL = {
    SPACE: -20.0, "a": -21.0, "b": -22.0, "c": -23.0, "d": -24.0, "x": -25.0, "é": -26.0,
    "ab": -3.0, "bc": -2.0, "aa": -5.0, f"{SPACE}a": -4.0, f"{SPACE}b": -6.0, "cd": -1.0,
    f"{SPACE}{SPACE}": -7.0, "abc": -8.0, f"{SPACE}ab": -9.0,
}  # fmt: skip


def spm_meta(normal: dict[str, float] | None = None, **extra) -> dict:
    rows = HEAD + [(t, s, 1) for t, s in (NORMAL if normal is None else normal).items()]
    meta = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [r[0] for r in rows],
        "tokenizer.ggml.scores": [float(r[1]) for r in rows],
        "tokenizer.ggml.token_type": [r[2] for r in rows],
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
    }
    return {**meta, **{f"tokenizer.ggml.{k}": v for k, v in extra.items()}}


def spm_tokenizer(tmp_path, normal=None, **extra):
    """The tokenizer of a tiny GGUF file (written, then read back like a model's metadata)."""
    path = str(tmp_path / "spm.gguf")
    write_gguf(path, spm_meta(normal, **extra), {})
    meta = read_metadata(path)
    return tokenizer_from_gguf(path, meta), meta


def pieces(tok, text: str) -> list[str]:
    return [tok.id_to_token(i) for i in tok.encode(text)]


def test_spm_highest_score_merges_first_ties_leftmost(tmp_path):
    tok, _ = spm_tokenizer(tmp_path, add_space_prefix=False)
    assert pieces(tok, "bcd") == ["b", "cd"]  # cd (-1) before bc (-2); "bcd" is no token
    assert pieces(tok, "abcd") == ["ab", "cd"]  # cd first, then ab
    assert pieces(tok, "abc") == ["abc"]  # bc, then a + bc
    assert pieces(tok, "aaa") == ["aa", "a"]  # the same pair twice: the leftmost
    swapped, _ = spm_tokenizer(tmp_path, {**NORMAL, "bc": -0.5}, add_space_prefix=False)
    assert pieces(swapped, "bcd") == ["bc", "d"]
    assert pieces(tok, "a b") == ["a", f"{SPACE}b"]
    assert pieces(tok, "  a") == [SPACE, f"{SPACE}a"]  # ▁a (-4) before ▁▁ (-7)
    assert pieces(tok, "   ") == [f"{SPACE}{SPACE}", SPACE]


def test_spm_byte_fallback_and_decode(tmp_path):
    tok, _ = spm_tokenizer(tmp_path, add_space_prefix=False)
    # "ü" (2 bytes), "日" (3), "🎉" (4) are not in the vocabulary: their UTF-8 bytes
    assert pieces(tok, "aüb") == ["a", "<0xC3>", "<0xBC>", "b"]
    assert pieces(tok, "日") == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert pieces(tok, "🎉") == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    assert pieces(tok, "é") == ["é"]  # in the vocabulary: no bytes
    for text in ["aüb", "日本 🎉x", " a  b ", "x\n\ty", "\x00\x7f"]:
        assert tok.decode(tok.encode(text)) == text
    # a character cut in the middle decodes to U+FFFD until its last byte arrives
    ids = tok.encode("日")
    assert tok.decode(ids[:2]) == "\ufffd\ufffd" and tok.decode(ids) == "日"


def test_spm_space_prefix(tmp_path):
    default, meta = spm_tokenizer(tmp_path)  # no add_space_prefix key: llama.cpp's default, true
    assert "tokenizer.ggml.add_space_prefix" not in meta
    assert pieces(default, "ab") == [f"{SPACE}ab"]
    assert pieces(default, "a b") == [f"{SPACE}a", f"{SPACE}b"]
    # after a control or user-defined token the next piece gets the prefix space again, as in llama.cpp
    assert pieces(default, "ab<ctl>ab<tag>b") == [f"{SPACE}ab", "<ctl>", f"{SPACE}ab", "<tag>", f"{SPACE}b"]
    for text in ["ab", " ab", "a  b", "<ctl>", ""]:
        assert default.decode(default.encode(text)) == text, text
    # only the text's first space is dropped when decoding (llama.cpp's detokenizer does the same), so
    # text after a special token does not round-trip under a prefix space, in llama.cpp either
    assert default.decode(default.encode("ab<ctl>x")) == "ab<ctl> x"
    off, _ = spm_tokenizer(tmp_path, add_space_prefix=False)
    assert pieces(off, "ab") == ["ab"] and pieces(off, "ab<ctl>ab") == ["ab", "<ctl>", "ab"]


def test_spm_token_types_and_bos(tmp_path):
    tok, _ = spm_tokenizer(tmp_path, add_space_prefix=False)
    # control, unknown and user-defined tokens written in the text are their ids; unused ones are not
    assert tok.encode("a<ctl>b<unk><tag>") == [tok.token_to_id("a"), 4, tok.token_to_id("b"), 3, 5]
    assert 6 not in tok.encode("<unused0>")
    assert tok.special_ids == frozenset({0, 1, 2, 3, 4})
    assert tok.decode([4, 5, 3]) == "<ctl><tag><unk>"
    assert tok.decode([4, 5, 3], skip_special_tokens=True) == "<tag>"
    assert tok.decode([tok.token_to_id("a"), 6, tok.token_to_id("b")]) == "ab"  # unused: nothing
    # BOS: add_bos_token is llama.cpp's default (true) for SentencePiece; never doubled
    assert tok.add_bos and tok.encode("ab", add_special_tokens=True) == [2, *tok.encode("ab")]
    assert tok.encode("<bos>ab", add_special_tokens=True) == tok.encode("<bos>ab")
    assert tok.encode("") == [] and tok.encode("", add_special_tokens=True) == [2]
    no_bos, _ = spm_tokenizer(tmp_path, add_bos_token=False)
    assert no_bos.encode("ab", add_special_tokens=True) == no_bos.encode("ab")
    assert (tok.bos_token_id, tok.eos_token_ids) == (2, (1,))


def test_spm_stream_decoder(tmp_path):
    for prefix in (False, True):
        tok, _ = spm_tokenizer(tmp_path, add_space_prefix=prefix)
        for text in ["a 日本 b🎉", "  ab  ", "ü<ctl>" if prefix else "ü<ctl> x", "é\x00é"]:
            ids = tok.encode(text)
            dec = StreamDecoder(tok)
            deltas = [dec.push(i) for i in ids] + [dec.flush()]
            assert "".join(deltas) == tok.decode(ids) == text, (prefix, text)
            assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("add_space_prefix", [False, True])
def test_spm_random_vocabularies_equal_llama_cpp_loop(tmp_path, add_space_prefix):
    """Random vocabularies over a few letters (distinct scores in random order, so merges compete and
    tokens have several splits), random texts with spaces, a cut-out token and a byte-fallback
    character: the same ids as the plain-Python llama.cpp loop."""
    mismatches = []
    for seed in range(8):
        rng = random.Random(seed)
        letters = ["a", "b", "c", SPACE]
        extra: set[str] = set()
        while len(extra) < 40:
            extra.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 5))))
        order = list(range(len(letters) + len(extra)))
        rng.shuffle(order)
        normal = dict(zip(letters + sorted(extra), (-float(o) for o in order), strict=True))
        tok, meta = spm_tokenizer(tmp_path, normal, add_space_prefix=add_space_prefix)
        ref = LlamaCppSpm(
            meta["tokenizer.ggml.tokens"],
            meta["tokenizer.ggml.scores"],
            meta["tokenizer.ggml.token_type"],
            add_space_prefix,
        )
        for _ in range(150):
            text = "".join(rng.choice("abc  ü") + ("<ctl>" if rng.random() < 0.05 else "") for _ in range(12))
            if tok.encode(text) != ref.encode(text):
                mismatches.append((seed, text))
    assert not mismatches


def test_spm_ties_between_tokens_are_warned(tmp_path, caplog):
    """Two different merge results of equal score: llama.cpp takes the leftmost pair, the BPE model
    its rank, so the builder says so (a file without scores ties everything)."""
    with caplog.at_level("WARNING"):
        spm_tokenizer(tmp_path, add_space_prefix=False)
    assert "share their score" not in caplog.text
    with caplog.at_level("WARNING"):
        spm_tokenizer(tmp_path, {**NORMAL, "ab": -2.0}, add_space_prefix=False)
    assert "1 merge results share their score" in caplog.text


def test_spm_bad_metadata(tmp_path):
    meta = spm_meta()
    with pytest.raises(ModelLoadError, match="scores must be a list"):
        tokenizer_from_gguf("x.gguf", {**meta, "tokenizer.ggml.scores": [0.0]})
    with pytest.raises(ModelLoadError, match="token_type must be a list"):
        tokenizer_from_gguf("x.gguf", {**meta, "tokenizer.ggml.token_type": ["x"] * 300})
    with pytest.raises(ModelLoadError, match="tokens missing"):
        tokenizer_from_gguf("x.gguf", {**meta, "tokenizer.ggml.tokens": []})
    meta["tokenizer.ggml.add_space_prefix"] = False
    no_scores = {k: v for k, v in meta.items() if k != "tokenizer.ggml.scores"}
    assert tokenizer_from_gguf("x.gguf", no_scores).encode("é") == [
        tokenizer_from_gguf("x.gguf", meta).token_to_id("é")
    ]
