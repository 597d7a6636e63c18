"""MLX model folders (config.json + *.safetensors + tokenizer.json): ``model_type`` picks the
architecture; weights may be MLX-quantized; Q/K rows in Hugging Face order; norms get the
architecture's ``hf_norm_offset``."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import replace
from typing import Any

import mlx.core as mx

import engine_service.model.arch as registry
from engine_service.api.errors import ModelLoadError
from engine_service.model.arch.base import HF
from engine_service.model.config import ModelConfig
from engine_service.model.formats.weights import QuantTensor, named_tensor


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(path, f"cannot read JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def folder_tensors(
    path: str, config: ModelConfig, quant: dict[str, Any] | None
) -> dict[str, mx.array | QuantTensor]:
    """Canonical tensors from the folder's safetensors."""
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
    arch = registry.architecture(config.architecture)
    shapes = arch.shapes(config)
    out: dict[str, mx.array | QuantTensor] = {}
    for canon, name in arch.tensor_names(config, HF).items():
        if canon == "lm_head" and config.tie_embeddings:
            continue
        if canon.endswith("_bias"):
            tensor = raw.get(name)
            if tensor is None:
                raise ModelLoadError(path, f"tensor {name} is missing")
        else:
            tensor = named_tensor(path, raw, name.removesuffix(".weight"), group, optional=canon == "lm_head")
            if tensor is None:
                continue
        if tuple(tensor.shape) != shapes[canon]:
            raise ModelLoadError(
                path, f"tensor {canon} has shape {tuple(tensor.shape)}, expected {shapes[canon]}"
            )
        if arch.is_norm(canon) and arch.hf_norm_offset:
            tensor = tensor.astype(mx.float32) + arch.hf_norm_offset
        out[canon] = tensor
    return out


def load_folder(path: str) -> tuple[ModelConfig, dict[str, mx.array | QuantTensor], str | None]:
    """(config, canonical tensors, chat template or None) of an MLX model folder."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(path, "folder has no config.json (expected an MLX model folder or a .gguf file)")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ModelLoadError(path, "folder has no tokenizer.json")
    cfg = read_json(cfg_path)
    config = registry.for_model_type(cfg.get("model_type"), path).config_from_hf(cfg, path)
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
