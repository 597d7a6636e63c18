"""MLX-format model folders (the mlx-community layout): config.json + *.safetensors + tokenizer.json.

Weights may be MLX-quantized (a ``"quantization": {"group_size", "bits"}`` entry in config.json; each
quantized matrix has ``.weight`` uint32, ``.scales`` and ``.biases``). Q/K rows are in Hugging Face
order, so RoPE is the default (non-traditional) one.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace
from typing import Any

import mlx.core as mx

from engine_service.errors import ModelLoadError
from engine_service.model.config import ModelConfig, layer_specs
from engine_service.model.weights import QuantTensor, named_tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q",
    "self_attn.k_proj": "k",
    "self_attn.v_proj": "v",
    "self_attn.o_proj": "o",
    "post_attention_layernorm": "mlp_norm",
    "mlp.gate_proj": "gate",
    "mlp.up_proj": "up",
    "mlp.down_proj": "down",
}


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"cannot read JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def folder_config(path: str, cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            path, f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ModelLoadError(path, f"rope_scaling {scaling!r} is not supported")
    try:
        hidden, heads, n_layers = (
            int(cfg["hidden_size"]),
            int(cfg["num_attention_heads"]),
            int(cfg["num_hidden_layers"]),
        )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            layers=layer_specs(
                n_layers, cfg.get("sliding_window"), cfg.get("layer_types"), cfg.get("sliding_window_pattern")
            ),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            rope_traditional=False,
            architecture=model_type,
        )
    except KeyError as exc:
        raise ModelLoadError(path, f"config.json lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(path, f"bad config.json: {exc}") from None


def folder_tensors(
    path: str, config: ModelConfig, quant: dict[str, Any] | None
) -> dict[str, mx.array | QuantTensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(path, "no *.safetensors weight files in the folder")
    raw: dict[str, mx.array] = {}
    for f in files:
        try:
            raw.update(mx.load(f))
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f, f"cannot read safetensors: {exc}") from None
    group = int(quant.get("group_size", 64)) if quant else None

    def get(name: str, optional: bool = False) -> mx.array | QuantTensor | None:
        return named_tensor(path, raw, name, group, optional)

    out: dict[str, mx.array | QuantTensor] = {"embed": get("model.embed_tokens"), "norm": get("model.norm")}
    head = None if config.tie_embeddings else get("lm_head", optional=True)
    if head is not None:
        out["lm_head"] = head
    for i in range(config.num_layers):
        for hf_name, name in _LAYER_NAMES.items():
            out[f"layers.{i}.{name}"] = get(f"model.layers.{i}.{hf_name}")
    for name, tensor in out.items():
        if name.endswith("norm") and tuple(tensor.shape) != (config.hidden_size,):
            raise ModelLoadError(path, f"tensor {name} has shape {tuple(tensor.shape)}")
    return out


def load_folder(path: str) -> tuple[ModelConfig, dict[str, mx.array | QuantTensor], str | None]:
    """(config, canonical tensors, chat template or None) of an MLX model folder."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(path, "folder has no config.json (expected an MLX model folder or a .gguf file)")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ModelLoadError(path, "folder has no tokenizer.json")
    cfg = read_json(cfg_path)
    config = folder_config(path, cfg)
    tensors = folder_tensors(path, config, cfg.get("quantization"))
    if "lm_head" not in tensors and not config.tie_embeddings:  # no separate head stored: it is tied
        config = replace(config, tie_embeddings=True)
    return config, tensors, _chat_template(path)


def _chat_template(path: str) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    tok_cfg = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tok_cfg):
        template = read_json(tok_cfg).get("chat_template")
        return template if isinstance(template, str) else None
    return None
