"""Tiny Hugging Face folders: config.json of each model_type, safetensors with HF names (q_proj.bias,
q_norm, qkv_proj, gate_up_proj, Gemma's pre/post_feedforward_layernorm; Gemma norms stored as ``w``),
tokenizer.json."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers
from tokenizers import models as tokenizer_models

from engine_service.model.config import ModelConfig
from tests.model.arch_files.tiny_archs import (
    EPS,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    VOCAB,
    Spec,
    expected_config,
    is_norm,
)
from tests.model.gguf_writer import tiny_vocab

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


def hf_name(spec: Spec, canon: str) -> str:
    if canon in HF_GLOBAL:
        return HF_GLOBAL[canon]
    _, i, r = canon.split(".")
    table = {**HF_LAYER, **HF_GEMMA} if spec.arch == "gemma3" else HF_LAYER
    return f"model.layers.{i}.{table[r]}"


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
