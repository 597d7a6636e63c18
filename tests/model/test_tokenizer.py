"""The GGUF-built SmolLM2 tokenizer, incremental detokenization and chat formatting."""

from __future__ import annotations

import json
import os

import pytest

from engine_service.model.chat import ChatFormatter
from engine_service.model.detokenizer import StreamDecoder
from engine_service.model.gguf import read_gguf
from engine_service.model.loader import default_model_path
from engine_service.model.tokenizer import tokenizer_from_gguf

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_tokenizer_ids.json")
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
    return path, read_gguf(path)[1]


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
    from engine_service.errors import ModelLoadError

    path, m = meta
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'qwen2'"):
        tokenizer_from_gguf(path, {**m, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama'"):
        tokenizer_from_gguf(path, {**m, "tokenizer.ggml.model": "llama"})


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
