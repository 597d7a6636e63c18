"""GGUF-built tokenizers (SmolLM2's byte-level BPE, SentencePiece BPE: tiny vocabularies and Gemma 3)
against llama.cpp, incremental detokenization and chat formatting.

The llama.cpp fixtures (``fixtures/llamacpp_tokens_*.json``) come from its server's ``/tokenize``
(``bench/llamacpp_tokens.py``); ``tests/model/llamacpp_spm.py`` is a plain-Python rewrite of the loop
llama.cpp's SentencePiece tokenizer runs, to compare against on many random strings (tiny SentencePiece
vocabularies: tests/unit/model/test_spm_tokenizer.py).
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from engine_service.api.errors import ModelLoadError
from engine_service.model.loading.gguf_file import read_metadata
from engine_service.model.loading.loader import default_model_path
from engine_service.model.loading.packaged import packaged_path
from engine_service.model.text.chat import ChatFormatter
from engine_service.model.text.detokenizer import StreamDecoder
from engine_service.model.text.tokenizer import tokenizer_from_gguf
from tests.model.llamacpp_spm import SPACE, LlamaCppSpm

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FIXTURE = os.path.join(FIXTURES, "smollm2_tokenizer_ids.json")
GEMMA_FIXTURE = os.path.join(FIXTURES, "llamacpp_tokens_gemma-3-270m-q4_k_m.json")
SMOLLM2_FIXTURE = os.path.join(FIXTURES, "llamacpp_tokens_smollm2-135m-instruct.q4_1.json")
TEXTS = [
    "Hello, world!",
    "Café, naïve, élève — «très» bien",
    "你好，世界！",
    "Emoji 🚀🎉👍🏽 and 🇫🇷",
    "def f(x):\n    return x**2  # 1234",
    "  spaces   and\ttabs\n\n",
]


@pytest.fixture(scope="module")
def meta():
    path = default_model_path()
    return path, read_metadata(path)


@pytest.fixture(scope="module")
def tok(meta):
    return tokenizer_from_gguf(*meta)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens(tok):
    assert tok.vocab_size == 49152
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # SmolLM2: add_bos_token is false


def test_digits_split_and_no_prefix_space(tok):
    ids = tok.encode("12345")
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]
    assert not tok.decode(tok.encode("Hello")[:1]).startswith(" ")


def test_decode_rejects_unknown_ids(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([49152])


def test_unsupported_tokenizer_metadata(meta):
    path, m = meta
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'qwen2'"):
        tokenizer_from_gguf(path, {**m, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(ModelLoadError, match="tokenizer model 'bert'"):
        tokenizer_from_gguf(path, {**m, "tokenizer.ggml.model": "bert"})


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_concatenation_equals_full_decode(tok, text):
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    deltas = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_stream_decoder_handles_split_characters(tok):
    """Negative control: the emoji text really splits characters across tokens (per-token decode breaks)."""
    ids = tok.encode("🚀🎉👍🏽")
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    dec = StreamDecoder(tok)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "🚀🎉👍🏽"


@pytest.mark.slow
def test_ids_equal_llama_cpp_fixture(meta, tok):
    """Ids from an independent tokenizer (llama.cpp, see the fixture's _source) for multilingual text."""
    with open(FIXTURE, encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    for case in cases:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    # negative controls: another pre-tokenizer split, or the lowest-priority merges missing, is caught
    path, m = meta
    other_split = tokenizer_from_gguf(path, {**m, "tokenizer.ggml.pre": "llama-bpe"})
    assert any(other_split.encode(c["text"]) != c["ids"] for c in cases)
    fewer_merges = tokenizer_from_gguf(
        path, {**m, "tokenizer.ggml.merges": m["tokenizer.ggml.merges"][:-2000]}
    )
    assert any(fewer_merges.encode(c["text"]) != c["ids"] for c in cases)


def test_model_chat_template_and_chatml(meta):
    template = meta[1]["tokenizer.chat_template"]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = ChatFormatter(template).format(messages)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert ChatFormatter(template).format(with_system) == ChatFormatter(name="chatml").format(with_system)
    assert ChatFormatter(template).format(messages, add_generation_prompt=False).endswith("<|im_end|>\n")


def test_named_formats():
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatFormatter(name="llama3", bos_token="<|begin_of_text|>").format(msgs) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ChatFormatter(name="gemma", bos_token="<bos>").format(msgs) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    )
    assert ChatFormatter(name="none").format(msgs) == "hi"
    with pytest.raises(ValueError, match="chat format must be one of"):
        ChatFormatter(name="alpaca")
    with pytest.raises(ValueError, match="role"):
        ChatFormatter(name="chatml").format([{"content": "x"}])


# --- llama.cpp fixtures: shared checks --------------------------------------------------------------


def _load_fixture(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _check_fixture(tok, fixture: dict) -> None:
    cases = fixture["cases"]
    assert len(cases) >= 25
    wrong = [c["text"] for c in cases if tok.encode(c["text"]) != c["ids"]]
    assert not wrong, wrong
    for c in cases:
        # llama.cpp's ids decode to what its /detokenize gives; where that is the text, it round-trips
        assert tok.decode(c["ids"]) == c["detokenized"], c["text"]
        if c["detokenized"] == c["text"]:
            assert tok.decode(tok.encode(c["text"])) == c["text"], c["text"]
        dec = StreamDecoder(tok)
        deltas = [dec.push(i) for i in c["ids"]] + [dec.flush()]
        assert "".join(deltas) == tok.decode(c["ids"]), c["text"]
        assert not any("\ufffd" in d for d in deltas), c["text"]


def test_smollm2_equals_llama_cpp_server(meta, tok, monkeypatch):
    fixture = _load_fixture(SMOLLM2_FIXTURE)
    assert fixture["model"] == os.path.basename(default_model_path())
    _check_fixture(tok, fixture)
    # only the string with bytes SmolLM2 has no token for (dropped by both) does not round-trip
    assert [c["text"] for c in fixture["cases"] if c["detokenized"] != c["text"]] == ["   \x13| a\x04b \x1d!"]
    # negative control: without isolating those bytes, their neighbours merge across them
    import engine_service.model.text.tokenizer as tokenizer_module

    real = tokenizer_module.pre_tokenizers

    class NoMissingBytes:
        def __getattr__(self, name):
            if name != "ByteLevel":
                return getattr(real, name)
            return type(
                "ByteLevel", (), {"__new__": lambda cls, **kw: real.ByteLevel(**kw), "alphabet": list}
            )

    monkeypatch.setattr(tokenizer_module, "pre_tokenizers", NoMissingBytes())
    merged_across = tokenizer_from_gguf(*meta)
    wrong = [c["text"] for c in fixture["cases"] if merged_across.encode(c["text"]) != c["ids"]]
    assert wrong == ["   \x13| a\x04b \x1d!"]


# --- Gemma 3 270M (tokenizer.ggml.model = "llama", 262,144 tokens) ----------------------------------


@pytest.fixture(scope="module")
def gemma():
    try:
        path = packaged_path("gemma-3-270m", assemble=False)
    except ModelLoadError as exc:
        pytest.skip(f"Gemma 3 GGUF not installed: {exc}")
    meta = read_metadata(path)
    start = time.perf_counter()
    tok = tokenizer_from_gguf(path, meta)
    return path, meta, tok, time.perf_counter() - start


@pytest.mark.slow
def test_gemma_equals_llama_cpp_server(gemma):
    path, meta, tok, build_s = gemma
    fixture = _load_fixture(GEMMA_FIXTURE)
    assert fixture["model"] == os.path.basename(path)
    assert meta["tokenizer.ggml.model"] == "llama" and tok.vocab_size == 262144
    assert build_s < 30  # measured ~2 s
    _check_fixture(tok, fixture)


@pytest.mark.slow
def test_gemma_negative_controls(gemma):
    """The fixture tells apart a tokenizer without byte fallback and one with the merges ranked the
    wrong way round, so the parity test can fail."""
    path, meta, _, _ = gemma
    cases = _load_fixture(GEMMA_FIXTURE)["cases"]
    types = meta["tokenizer.ggml.token_type"]
    no_bytes = [
        t if ty != 6 else f"[byte {i}]"
        for i, (t, ty) in enumerate(zip(meta["tokenizer.ggml.tokens"], types, strict=True))
    ]
    without_fallback = tokenizer_from_gguf(path, {**meta, "tokenizer.ggml.tokens": no_bytes})
    assert any(without_fallback.encode(c["text"]) != c["ids"] for c in cases)
    ascending = tokenizer_from_gguf(
        path, {**meta, "tokenizer.ggml.scores": [-s for s in meta["tokenizer.ggml.scores"]]}
    )
    assert any(ascending.encode(c["text"]) != c["ids"] for c in cases)
    with_prefix = tokenizer_from_gguf(path, {**meta, "tokenizer.ggml.add_space_prefix": True})
    assert any(with_prefix.encode(c["text"]) != c["ids"] for c in cases)


@pytest.mark.slow
def test_gemma_random_text_equals_llama_cpp_loop(gemma):
    """Random texts from Gemma's own pieces, scripts, emoji, whitespace and special-token texts: the
    same ids as the plain-Python llama.cpp loop."""
    _, meta, tok, _ = gemma
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    ref = LlamaCppSpm(tokens, meta["tokenizer.ggml.scores"], types, add_space_prefix=False)
    normal = [t.replace(SPACE, " ") for t, ty in zip(tokens, types, strict=True) if ty == 1]
    rng = random.Random(0)
    specials = ["<start_of_turn>", "<end_of_turn>", "<b>", "</td>", "<0x41>", "<unused3>", "\n\n", "   "]

    def part() -> str:
        r = rng.random()
        if r < 0.55:
            return rng.choice(normal)
        if r < 0.65:
            return rng.choice(normal)[::-1]
        if r < 0.8:
            return chr(
                rng.choice(
                    [rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]
                )
            )
        if r < 0.9:
            return rng.choice([" ", "  ", "\n", "\t", " \n "])
        return rng.choice(specials)

    texts = ["".join(part() for _ in range(rng.randint(1, 12))) for _ in range(1000)]
    assert [t for t in texts if tok.encode(t) != ref.encode(t)] == []


@pytest.mark.slow
def test_gemma_special_tokens_bos_and_speed(gemma):
    _, _, tok, _ = gemma
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (2, (1,), True)
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n")
    assert ids[0] == 105 and 106 in ids and 107 in ids  # control tokens; "\n" is user-defined (107)
    assert tok.encode("Hi", add_special_tokens=True) == [2, *tok.encode("Hi")]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi\n"
    prose = _load_fixture(GEMMA_FIXTURE)["cases"][-1]["text"]
    text = " ".join([prose] * 12)
    n = len(tok.encode(text))
    assert 1200 < n < 2500
    start = time.process_time()  # CPU time: the claims are the tokenizer's cost, not the machine's load
    for _ in range(10):
        tok.encode(text)
    per_call = (time.process_time() - start) / 10
    assert per_call < 0.05, f"{n} tokens in {per_call * 1e3:.1f} ms"  # measured ~1 ms
    # streaming: two short decodes per token (measured ~4 us a token; 0.9 ms when vocab_size, which
    # every decode checks ids against, was recounted per call)
    ids = tok.encode(text)
    dec = StreamDecoder(tok, skip_special_tokens=True)
    start = time.process_time()
    streamed = "".join(dec.push(i) for i in ids) + dec.flush()
    elapsed = time.process_time() - start
    assert streamed == text and elapsed < 0.3, f"{len(ids)} tokens streamed in {elapsed * 1e3:.0f} ms"


@pytest.mark.slow
@pytest.mark.parametrize("stride", [1, 64])
def test_gemma_chunked_encoding_equals_whole_text(gemma, monkeypatch, stride):
    """Texts cut into pieces where no Gemma token can span (``chunked_encoding.py``): the ids joined equal
    the whole text's, with Gemma's space-run added tokens, ``>▁</`` and control tokens in the texts."""
    from engine_service.model.text import chunked_encoding

    _, meta, tok, _ = gemma
    monkeypatch.setattr(chunked_encoding, "STRIDE", stride)
    normal = [t.replace(SPACE, " ") for t, ty in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True) if ty == 1]  # fmt: skip
    rng = random.Random(stride)
    odd = ["> </", " ", "  ", "   ", "\n", "\t", "<start_of_turn>", "<end_of_turn>", "> <", "é", "日本"]
    texts = [
        "".join(rng.choice(odd if rng.random() < 0.3 else normal) for _ in range(200)) for _ in range(150)
    ]
    scoped = tok.scoped("owner")
    assert [t for t in texts if scoped.encode(t, True) != tok.encode(t, True)] == []
    assert sum(len(chunked_encoding.cuts(t, tok._cut, stride)) for t in texts) > 150  # texts were cut
