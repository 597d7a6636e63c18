"""Qwen2, Qwen3, Phi-3 and Gemma 3 (Llama as the control) from files the tests write themselves, laid out
the way llama.cpp's converter and Hugging Face checkpoints lay them out, against the naive float64
forward (tests/model/naive_reference.py); no real file of these architectures ships in a package.

GGUF files (llama.cpp's names; gguf-py's ``MODEL_TENSORS`` / ``TensorNameMap`` as the oracle for them):
- qwen2: ``attn_{q,k,v}.bias``; qwen3: ``attn_{q,k}_norm`` and ``attention.key_length`` != hidden / heads;
- phi3: ``attn_qkv`` (q, k, v rows) and ``ffn_up`` holding gate rows then up rows; a window on every layer;
- gemma3: QK-norm, ``post_attention_norm``, ``ffn_norm`` (pre-FFN), ``post_ffw_norm``, norms stored as
  ``1 + w`` (what the converter writes), six layers so the sixth is global, tied head;
- Q/K rows permuted per head for llama only (the converter permutes no other architecture);
- matrices in the block types of a typical Q4_K_M file (Q8_0 embedding, Q5_0 q/k, Q4_0 v, Q4_1 o, Q4_K
  gate/up, Q6_K down and head): hidden 256, intermediate 512, so every K-quant row is whole super-blocks.

``float32`` loading must equal the reference on the values the blocks stand for (the writer's own
dequantization) up to float32 rounding; ``auto`` keeps every exact format (Q5_0/Q8_0 -> q8_0; Q4_0, Q4_1,
Q4_K -> q4_1) and requantizes only Q6_K to q8_0: it equals the reference on the values the model holds,
and the requantization's own loss is measured and bounded.

Hugging Face folders: config.json of each model_type, safetensors with HF names (q_proj.bias, q_norm,
qkv_proj, gate_up_proj, Gemma's pre/post_feedforward_layernorm; Gemma norms stored as ``w``), tokenizer.json.
Negative controls show each convention is visible in the logits, and the loader's refusals name the tensor.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers import models as tokenizer_models

from engine_service.api.errors import ModelLoadError
from engine_service.cache.config import FULL, SLIDING, LayerSpec
from engine_service.model import load_model
from engine_service.model.config import ModelConfig
from engine_service.model.projections import SplitProjection
from tests.model import naive_reference
from tests.model.gguf_writer import QUANTIZERS, BlockQuant, permute_for_gguf, tiny_vocab, write_gguf
from tests.model.reference_cache import ReferenceCache, run

TOKENS = [5, 17, 99, 3, 42, 42, 7, 120, 64, 1, 33, 8, 91, 27]  # 14 positions > the window of 4
HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 256, 4, 2, 512, 128
EPS = 1e-6
# float32 vs float64 over the same values: logits here are O(1) (max |logit| ~3), float32 rounding of
# a few 256-/512-long dot products per layer stays near 1e-6 relative
ATOL = 1e-4


@dataclass(frozen=True)
class Spec:
    """One architecture's tiny shape: ``head_dim`` None = hidden / heads; ``window``: sliding size."""

    arch: str
    layers: int = 2
    head_dim: int | None = None
    window: int | None = None
    theta: float = 10000.0
    tied: bool = True
    hf_type: str = ""

    @property
    def d(self) -> int:
        return self.head_dim or HIDDEN // HEADS


SPECS = {
    "llama": Spec("llama", tied=False, hf_type="llama"),
    "qwen2": Spec("qwen2", theta=1e6, hf_type="qwen2"),
    "qwen3": Spec("qwen3", head_dim=48, theta=1e6, hf_type="qwen3"),
    "phi3": Spec("phi3", window=4, tied=False, hf_type="phi3"),
    "gemma3": Spec("gemma3", layers=6, head_dim=96, window=4, theta=1e6, hf_type="gemma3_text"),
}
ARCHS = sorted(SPECS)

_BASE = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")
LAYER_TENSORS = {
    "llama": _BASE,
    "qwen2": (*_BASE, "q_bias", "k_bias", "v_bias"),
    "qwen3": (*_BASE, "q_norm", "k_norm"),
    "phi3": ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"),
    "gemma3": (*_BASE, "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"),
}

# canonical -> llama.cpp's name under blk.i. (convert_hf_to_gguf.py / gguf-py tensor_mapping.py)
GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "qkv": "attn_qkv.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "o": "attn_output.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "gate_up": "ffn_up.weight",  # Phi-3: gate rows then up rows in one tensor
    "down": "ffn_down.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
}
GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
# canonical -> the Hugging Face name under model.layers.i.
HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "qkv": "self_attn.qkv_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "o": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "gate_up": "mlp.gate_up_proj.weight",
    "down": "mlp.down_proj.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
HF_GEMMA = {
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
}
HF_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}

# block type per matrix role, as in a Q4_K_M file; norms and biases stay F32
QUANT = {
    "embed": "Q8_0",
    "lm_head": "Q6_K",
    "q": "Q5_0",
    "k": "Q5_0",
    "qkv": "Q5_0",
    "v": "Q4_0",
    "o": "Q4_1",
    "gate": "Q4_K",
    "up": "Q4_K",
    "gate_up": "Q4_K",
    "down": "Q6_K",
}


def role(canon: str) -> str:
    return canon.rsplit(".", 1)[-1]


def is_norm(canon: str) -> bool:
    return canon == "norm" or canon.endswith("_norm")


# ---- the models -----------------------------------------------------------------------------------------


def expected_config(spec: Spec, eps: float = EPS, **changes) -> ModelConfig:
    """The config the files describe, written out by hand (Hugging Face semantics: default RoPE)."""
    layers = []
    for i in range(spec.layers):
        sliding = spec.window is not None and not (spec.arch == "gemma3" and (i + 1) % 6 == 0)
        layers.append(LayerSpec(SLIDING, spec.window) if sliding else LayerSpec(FULL))
    gemma = spec.arch == "gemma3"
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=spec.layers,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=spec.d,
        intermediate_size=INTER,
        rope_theta=spec.theta,
        rms_norm_eps=eps,
        tie_embeddings=spec.tied,
        layers=tuple(layers),
        context_length=4096,
        bos_token_id=1,
        eos_token_ids=(2,),
        rope_traditional=False,
        architecture=spec.arch,
        rope_local_theta=10000.0 if gemma else None,
        attn_scale=spec.d**-0.5 if gemma else None,
    )
    fields.update(changes)
    return ModelConfig(**fields)


def shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    q, kv = HEADS * spec.d, KV_HEADS * spec.d
    per_layer = {
        "attn_norm": (HIDDEN,), "mlp_norm": (HIDDEN,), "post_attn_norm": (HIDDEN,), "post_mlp_norm": (HIDDEN,),
        "q": (q, HIDDEN), "k": (kv, HIDDEN), "v": (kv, HIDDEN), "qkv": (q + 2 * kv, HIDDEN),
        "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": (spec.d,), "k_norm": (spec.d,),
        "o": (HIDDEN, q), "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
        "down": (HIDDEN, INTER),
    }  # fmt: skip
    out = {"embed": (VOCAB, HIDDEN), "norm": (HIDDEN,)}
    if not spec.tied:
        out["lm_head"] = (VOCAB, HIDDEN)
    for i in range(spec.layers):
        for canon in LAYER_TENSORS[spec.arch]:
            out[f"layers.{i}.{canon}"] = per_layer[canon]
    return out


def random_model(spec: Spec, seed: int = 3) -> dict[str, np.ndarray]:
    """Canonical float32 tensors in Hugging Face row order. Norms are the multipliers the math uses
    (1 + 0.1 N(0, 1); for Gemma that is 1 + w), biases 0.1 N(0, 1), matrices N(0, 1) / sqrt(in) (q, k
    and their fused rows twice that, so attention is far from uniform)."""
    rng = np.random.default_rng(seed)
    out = {}
    for canon, shape in shapes(spec).items():
        r = role(canon)
        if len(shape) == 1:
            noise = rng.standard_normal(shape)
            value = 0.1 * noise if r.endswith("_bias") else 1.0 + 0.1 * noise
        else:
            gain = 2.0 if r in ("q", "k", "qkv") else 1.0
            value = rng.standard_normal(shape) * gain / np.sqrt(shape[1])
        out[canon] = value.astype(np.float32)
    return out


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute_for_gguf` (GGUF rows -> Hugging Face rows)."""
    out, d_in = w.shape
    return w.reshape(heads, out // heads // 2, 2, d_in).transpose(0, 2, 1, 3).reshape(out, d_in)


def gguf_name(canon: str) -> str:
    if canon in GGUF_GLOBAL:
        return GGUF_GLOBAL[canon]
    _, i, r = canon.split(".")
    return f"blk.{i}.{GGUF_LAYER[r]}"


def hf_name(spec: Spec, canon: str) -> str:
    if canon in HF_GLOBAL:
        return HF_GLOBAL[canon]
    _, i, r = canon.split(".")
    table = {**HF_LAYER, **HF_GEMMA} if spec.arch == "gemma3" else HF_LAYER
    return f"model.layers.{i}.{table[r]}"


def to_gguf(
    spec: Spec,
    tensors: dict[str, np.ndarray],
    *,
    quantize: bool = True,
    permute: bool | None = None,
    gemma_norm_offset: float = 0.0,
) -> tuple[dict[str, np.ndarray | BlockQuant], dict[str, np.ndarray]]:
    """(GGUF tensors by llama.cpp name, the canonical values they stand for in Hugging Face order).

    ``permute``: llama.cpp's per-head Q/K row permutation (default: for llama only). Gemma norms are
    written as the multipliers (1 + w, the converter's convention); ``gemma_norm_offset=-1`` writes
    ``w`` instead (a wrong file, for the negative control)."""
    permute = spec.arch == "llama" if permute is None else permute
    out: dict[str, np.ndarray | BlockQuant] = {}
    values = {}
    for canon, w in tensors.items():
        r = role(canon)
        heads = {"q": HEADS, "k": KV_HEADS}.get(r) if permute else None
        stored = permute_for_gguf(w, heads) if heads else w
        if spec.arch == "gemma3" and is_norm(canon):
            stored = stored + np.float32(gemma_norm_offset)
        kind = QUANT.get(r) if quantize else None
        if kind:
            block = QUANTIZERS[kind](stored)
            out[gguf_name(canon)], value = block, block.dequantized
        else:
            out[gguf_name(canon)] = value = stored.astype(np.float32)
        values[canon] = unpermute(value, heads) if heads else value
    return out, values


def gguf_metadata(spec: Spec, arch: str | None = None) -> dict:
    """What llama.cpp's converter writes for these hyper-parameters, plus a gpt2 tokenizer."""
    a = arch or spec.arch
    tokens, merges, types = tiny_vocab()
    meta = {
        "general.architecture": a,
        "general.name": f"tiny-{a}",
        f"{a}.context_length": 4096,
        f"{a}.embedding_length": HIDDEN,
        f"{a}.block_count": spec.layers,
        f"{a}.feed_forward_length": INTER,
        f"{a}.attention.head_count": HEADS,
        f"{a}.attention.head_count_kv": KV_HEADS,
        f"{a}.rope.freq_base": spec.theta,
        f"{a}.attention.layer_norm_rms_epsilon": EPS,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    if spec.head_dim:
        meta[f"{a}.attention.key_length"] = meta[f"{a}.attention.value_length"] = spec.head_dim
    if spec.window:
        meta[f"{a}.attention.sliding_window"] = spec.window
    if a == "phi3":
        meta[f"{a}.rope.dimension_count"] = spec.d
    return meta


def logits(model, tokens=TOKENS) -> np.ndarray:
    cache = ReferenceCache(model.config.layers)
    return np.asarray(run(model, cache, [(cache.seq_new(), 0, tokens)], all_rows=True)[0], dtype=np.float64)


def gap(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module")
def models() -> dict[str, dict[str, np.ndarray]]:
    return {arch: random_model(SPECS[arch]) for arch in ARCHS}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, models):
    """arch -> (path of the quantized GGUF, the canonical values it stands for, their reference logits)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ARCHS:
        spec = SPECS[arch]
        raw, values = to_gguf(spec, models[arch])
        path = str(root / f"{arch}.gguf")
        write_gguf(path, gguf_metadata(spec), raw)
        out[arch] = (path, values, naive_reference.forward(expected_config(spec), values, TOKENS))
    return out


def write_and_load(tmp_path, spec: Spec, raw: dict, name: str = "m.gguf", meta: dict | None = None):
    path = str(tmp_path / name)
    write_gguf(path, meta or gguf_metadata(spec), raw)
    return load_model(path, "float32")


def expect_error(path: str, match: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError, match=match) as info:
        load_model(path, "float32")
    assert info.value.path == path and "\n" not in str(info.value)
    return info.value


# ---- 1. GGUF files in llama.cpp's layout ------------------------------------------------------------------


def test_the_layouts_are_llama_cpps():
    """The test's GGUF names are in gguf-py's tensor list of each architecture, and its Hugging Face names
    map to them through gguf-py's TensorNameMap (what convert_hf_to_gguf.py renames by)."""
    gguf = pytest.importorskip("gguf")
    for arch in ARCHS:
        spec = SPECS[arch]
        arch_id = gguf.MODEL_ARCH[arch.upper()]
        known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch_id] for i in range(6)}
        mapping = gguf.get_tensor_name_map(arch_id, spec.layers)
        for canon in shapes(spec):
            name = gguf_name(canon)
            assert name.rsplit(".", 1)[0] in known, (arch, name)
            hf = hf_name(spec, canon)
            assert mapping.get_name(hf, try_suffixes=(".weight", ".bias")) == name, (arch, hf)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_float32_matches_the_naive_forward(arch, gguf_files):
    spec = SPECS[arch]
    path, _values, want = gguf_files[arch]
    loaded = load_model(path, "float32")
    # llama's rows are stored permuted: traditional RoPE on them; every other architecture: unpermuted
    eps = float(np.float32(EPS))  # GGUF stores the epsilon as float32
    assert loaded.config == expected_config(spec, eps, rope_traditional=arch == "llama")
    assert loaded.weights_dtype == "float32"
    got = logits(loaded.model)
    assert gap(got, want) < ATOL, gap(got, want)
    assert np.abs(want).max() > 1.0  # the logits are O(1): ATOL is a relative bound too


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_auto_keeps_block_formats(arch, gguf_files, models):
    """``auto`` (CPU kernels): Q5_0 / Q8_0 -> q8_0, Q4_0 / Q4_1 / Q4_K -> q4_1 without loss; Q6_K (down and
    an untied head) is requantized to q8_0. The model equals the reference on the values it holds (ATOL),
    and the requantization's loss is bounded by Q6_K's own: q8_0's half step is amax / 254 over 32
    weights, Q6_K's about amax / 62 over 16, so requantizing adds at most ~1/4 of the error Q6_K itself
    made. Measured over seeds 3-6, every architecture: max |logit gap| 0.016-0.032 (logits up to 3-7,
    i.e. ~1% of the logit scale, well above the 1e-3 a lossless path would give), 0.22-0.34 of Q6_K's
    own gap (0.06-0.13); bound: half of it."""
    from engine_service.model.cpu_kernels import kernel_status
    from engine_service.model.formats.weights import gpu_available

    if gpu_available() or not kernel_status().available:
        pytest.skip("auto keeps block formats only on the CPU with the compiled kernels")
    spec = SPECS[arch]
    path, values, want = gguf_files[arch]
    loaded = load_model(path, "auto")
    assert loaded.weights_dtype == "q4_1+q8_0"
    model = loaded.model
    layer = model.layers[0]
    if arch == "phi3":  # one stored tensor each: one kernel format each
        assert (layer.qkv.format, layer.gate_up.format) == ("q8_0", "q4_1")
    else:  # q, k q8_0 and v q4_1: split by format, v's part keeps its own bias
        assert isinstance(layer.qkv, SplitProjection) and layer.qkv.format == "q4_1+q8_0"
        assert layer.gate_up.format == "q4_1"
    assert (layer.o.format, layer.down.format, model.embed_tokens.format) == ("q4_1", "q8_0", "q8_0")
    held = dict(values)  # what the model holds: the file's values, Q6_K ones requantized
    for i, lay in enumerate(model.layers):
        held[f"layers.{i}.down"] = np.asarray(lay.down.tensor.dequantize())
    if not spec.tied:
        held["lm_head"] = np.asarray(model.lm_head.tensor.dequantize())
    got = logits(model)
    config = expected_config(spec)
    assert gap(got, naive_reference.forward(config, held, TOKENS)) < ATOL
    source = {k: models[arch][k] if QUANT.get(role(k)) == "Q6_K" else v for k, v in values.items()}
    q6_k_own = gap(want, naive_reference.forward(config, source, TOKENS))
    assert 1e-3 < gap(got, want) < 0.5 * q6_k_own, (gap(got, want), q6_k_own)


def test_phi3_gguf_as_llama_cpp_converts_the_4k_models_loads(tmp_path, models):
    """convert_hf_to_gguf.py's Phi3MiniModel writes ``phi3.rope.scaling.original_context_length``
    (original_max_position_embeddings, 4096) for every Phi-3, the 4k models included; LongRoPE files are
    the ones with ``rope_factors_long`` / ``rope_factors_short`` tensors and ``rope.scaling.attn_factor``."""
    spec = SPECS["phi3"]
    meta = gguf_metadata(spec)
    meta["phi3.rope.scaling.original_context_length"] = 4096
    raw, values = to_gguf(spec, models["phi3"], quantize=False)
    loaded = write_and_load(tmp_path, spec, raw, meta=meta)
    want = naive_reference.forward(expected_config(spec), values, TOKENS)
    assert gap(logits(loaded.model), want) < ATOL


def test_phi3_longrope_gguf_is_refused(tmp_path, models):
    """The 128k models: attn_factor in the metadata and rope_factors_* tensors; refused, not run wrong."""
    spec = SPECS["phi3"]
    meta = gguf_metadata(spec)
    meta["phi3.rope.scaling.attn_factor"] = 1.19
    meta["phi3.context_length"] = 131072
    raw, _ = to_gguf(spec, models["phi3"], quantize=False)
    raw["rope_factors_long.weight"] = np.ones(spec.d // 2, np.float32)
    raw["rope_factors_short.weight"] = np.ones(spec.d // 2, np.float32)
    path = str(tmp_path / "long.gguf")
    write_gguf(path, meta, raw)
    with pytest.raises(ModelLoadError, match="LongRoPE|rope_factors"):
        load_model(path, "float32")


def test_phi3_longrope_refusal_names_the_file(tmp_path, models):
    spec = SPECS["phi3"]
    meta = gguf_metadata(spec)
    meta["phi3.rope.scaling.attn_factor"] = 1.19
    raw, _ = to_gguf(spec, models["phi3"], quantize=False)
    path = str(tmp_path / "long.gguf")
    write_gguf(path, meta, raw)
    expect_error(path, "LongRoPE")


# ---- 2. Hugging Face folders ----------------------------------------------------------------------------


def hf_config(spec: Spec) -> dict:
    """config.json as each family's checkpoints write it (keys the loader may or may not read)."""
    cfg = {
        "model_type": spec.hf_type,
        "hidden_size": HIDDEN,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER,
        "vocab_size": VOCAB,
        "rms_norm_eps": EPS,
        "rope_theta": spec.theta,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_scaling": None,
        "torch_dtype": "float32",
    }
    if spec.arch == "qwen2":  # every released Qwen2: a window in the config, switched off
        cfg.update(use_sliding_window=False, sliding_window=131072, max_window_layers=21, hidden_act="silu")
    if spec.arch == "qwen3":
        cfg.update(head_dim=spec.d, attention_bias=False, use_sliding_window=False, sliding_window=None)
    if spec.arch == "phi3":
        cfg.update(sliding_window=spec.window, original_max_position_embeddings=4096, hidden_act="silu")
    if spec.arch == "gemma3":
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(spec.layers)]
        cfg.update(
            head_dim=spec.d,
            sliding_window=spec.window,
            layer_types=kinds,
            _sliding_window_pattern=6,
            rope_local_base_freq=10000.0,
            query_pre_attn_scalar=HIDDEN // HEADS,  # as the 27B model: not head_dim
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
        )
    return cfg


def hf_expected(spec: Spec) -> ModelConfig:
    if spec.arch == "gemma3":
        return expected_config(spec, attn_scale=(HIDDEN // HEADS) ** -0.5)
    return expected_config(spec)


def write_tokenizer(folder: str) -> None:
    tokens, merges, _ = tiny_vocab()
    backend = HFTokenizer(
        tokenizer_models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(os.path.join(folder, "tokenizer.json"))


def write_folder(
    folder, spec: Spec, tensors: dict[str, np.ndarray], *, norm_offset: float | None = None, drop=()
) -> str:
    """A Hugging Face / MLX folder. Gemma's norms are stored as ``w`` = multiplier - 1 (``norm_offset``
    overrides the -1, for the negative control)."""
    os.makedirs(folder, exist_ok=True)
    offset = (-1.0 if spec.arch == "gemma3" else 0.0) if norm_offset is None else norm_offset
    flat = {}
    for canon, w in tensors.items():
        name = hf_name(spec, canon)
        if name not in drop:
            flat[name] = mx.array(w + np.float32(offset) if is_norm(canon) else w)
    mx.save_safetensors(os.path.join(str(folder), "model.safetensors"), flat)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(spec), f)
    write_tokenizer(str(folder))
    return str(folder)


@pytest.mark.parametrize("arch", ARCHS)
def test_folder_matches_the_naive_forward(arch, tmp_path, models):
    spec = SPECS[arch]
    loaded = load_model(write_folder(tmp_path / arch, spec, models[arch]), "float32")
    config = hf_expected(spec)
    assert loaded.config == config
    want = naive_reference.forward(config, models[arch], TOKENS)
    assert gap(logits(loaded.model), want) < ATOL, gap(logits(loaded.model), want)


@pytest.mark.parametrize("keys", ["sliding_window_pattern", "neither"])
def test_gemma3_folder_older_config_keys(tmp_path, models, keys):
    """Gemma 3 configs written before ``layer_types`` existed: ``sliding_window_pattern`` 6, or only the
    window (every sixth layer global by the architecture's definition): the same model."""
    spec = SPECS["gemma3"]
    folder = write_folder(tmp_path / keys, spec, models["gemma3"])
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    del cfg["layer_types"], cfg["_sliding_window_pattern"]
    if keys == "sliding_window_pattern":
        cfg["sliding_window_pattern"] = 6
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    loaded = load_model(folder, "float32")
    assert loaded.config == hf_expected(spec)
    want = naive_reference.forward(hf_expected(spec), models["gemma3"], TOKENS)
    assert gap(logits(loaded.model), want) < ATOL


# ---- 3. negative controls ---------------------------------------------------------------------------------


def test_an_unread_tensor_refuses_the_file(tmp_path, models):
    """Llama 3's ``rope_freqs`` changes the RoPE frequencies: a file with it is not the model we'd run."""
    spec = SPECS["llama"]
    raw, _ = to_gguf(spec, models["llama"], quantize=False)
    raw["rope_freqs.weight"] = np.ones(spec.d // 2, np.float32)
    path = str(tmp_path / "extra.gguf")
    write_gguf(path, gguf_metadata(spec), raw)
    expect_error(path, r"tensor rope_freqs\.weight is not read by architecture 'llama' \(1 such tensors\)")


@pytest.mark.parametrize(
    "arch,drop",
    [
        ("qwen3", ["blk.1.attn_k_norm.weight"]),
        ("gemma3", ["blk.5.post_ffw_norm.weight"]),
        ("phi3", ["blk.0.attn_qkv.weight"]),
        ("qwen2", ["blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"]),  # qwen2 without biases
        ("qwen2", ["blk.1.attn_v.bias"]),
    ],
)
def test_a_missing_tensor_is_named(tmp_path, models, arch, drop):
    spec = SPECS[arch]
    raw, _ = to_gguf(spec, models[arch], quantize=False)
    for name in drop:
        del raw[name]
    path = str(tmp_path / "missing.gguf")
    write_gguf(path, gguf_metadata(spec), raw)
    expect_error(path, f"tensor {re.escape(drop[0])} is missing")


def test_a_wrong_shape_is_named(tmp_path, models):
    """Phi-3's ffn_up with only the up half (intermediate rows, not 2 * intermediate)."""
    spec = SPECS["phi3"]
    raw, _ = to_gguf(spec, models["phi3"], quantize=False)
    raw["blk.1.ffn_up.weight"] = raw["blk.1.ffn_up.weight"][INTER:]
    path = str(tmp_path / "shape.gguf")
    write_gguf(path, gguf_metadata(spec), raw)
    expect_error(path, r"tensor blk\.1\.ffn_up\.weight has shape \(512, 256\), expected \(1024, 256\)")


def test_gemma3_norms_stored_as_w_differ(tmp_path, models, gguf_files):
    """A Gemma 3 GGUF whose norms hold ``w`` instead of the converter's ``1 + w`` loads (nothing in a file
    says which) but computes another model: the float32 comparison above would catch a wrong offset."""
    spec = SPECS["gemma3"]
    raw, _ = to_gguf(spec, models["gemma3"], gemma_norm_offset=-1.0)
    loaded = write_and_load(tmp_path, spec, raw)
    assert gap(logits(loaded.model), gguf_files["gemma3"][2]) > 0.3


def test_phi3_gate_up_halves_swapped_differ(tmp_path, models, gguf_files):
    spec = SPECS["phi3"]
    swapped = dict(models["phi3"])
    for i in range(spec.layers):
        w = swapped[f"layers.{i}.gate_up"]
        swapped[f"layers.{i}.gate_up"] = np.concatenate([w[INTER:], w[:INTER]])
    raw, _ = to_gguf(spec, swapped)
    loaded = write_and_load(tmp_path, spec, raw)
    assert gap(logits(loaded.model), gguf_files["phi3"][2]) > 0.3


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_qk_permuted_like_llama_differs(tmp_path, models, gguf_files, arch):
    """Only llama's Q/K rows are permuted by the converter; reading another architecture's rows as if they
    were would be wrong, and visible."""
    spec = SPECS[arch]
    raw, _ = to_gguf(spec, models[arch], permute=True)
    loaded = write_and_load(tmp_path, spec, raw)
    assert gap(logits(loaded.model), gguf_files[arch][2]) > 0.3


def test_gemma3_folder_norms_stored_as_multipliers_differ(tmp_path, models):
    """A Gemma folder holding ``1 + w`` (the GGUF convention) gets 1 added again: visibly another model."""
    spec = SPECS["gemma3"]
    loaded = load_model(write_folder(tmp_path / "g", spec, models["gemma3"], norm_offset=0.0), "float32")
    want = naive_reference.forward(hf_expected(spec), models["gemma3"], TOKENS)
    assert gap(logits(loaded.model), want) > 0.3


def test_folder_without_qwen2_biases_is_refused(tmp_path, models):
    spec = SPECS["qwen2"]
    folder = write_folder(
        tmp_path / "q", spec, models["qwen2"], drop={"model.layers.0.self_attn.k_proj.bias"}
    )
    expect_error(folder, r"tensor model\.layers\.0\.self_attn\.k_proj\.bias is missing")


# ---- 4. unknown architectures -----------------------------------------------------------------------------


def test_unknown_architecture_lists_the_supported_ones(tmp_path, models):
    spec = SPECS["llama"]
    raw, _ = to_gguf(spec, models["llama"], quantize=False)
    path = str(tmp_path / "mamba.gguf")
    write_gguf(path, gguf_metadata(spec, arch="mamba"), raw)
    expect_error(path, r"unsupported architecture 'mamba' \(supported: gemma3, llama, phi3, qwen2, qwen3\)$")
    folder = write_folder(tmp_path / "mamba", spec, models["llama"])
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**cfg, "model_type": "mamba"}, f)
    expect_error(
        folder,
        r"unsupported model_type 'mamba' \(supported: gemma3_text, llama, mistral, phi3, qwen2, qwen3\)$",
    )


def test_expected_config_helper_is_not_the_engines():
    """The hand-written config differs from a naive guess where the architectures differ (sanity of the
    test itself: gemma3's sixth layer is global, phi3 slides everywhere, qwen3's head_dim is its own)."""
    g = expected_config(SPECS["gemma3"])
    assert [s.kind for s in g.layers] == [SLIDING] * 5 + [FULL]
    assert all(s.kind == SLIDING for s in expected_config(SPECS["phi3"]).layers)
    assert expected_config(SPECS["qwen3"]).q_size == 192 != HIDDEN
