"""Phi-3 (4k context): Llama-shaped with fused ``attn_qkv`` and ``ffn_up`` (gate rows, then up), stored
unpermuted, a sliding window on every layer; LongRoPE (128k) files are refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine_service.api.errors import ModelLoadError
from engine_service.model.arch.base import Architecture


class Phi3(Architecture):
    name = "phi3"
    gguf_names = ("phi3",)
    hf_model_types = ("phi3",)
    layer_tensors = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")
    gguf_rope_traditional = False

    def gguf_extra(
        self, meta: Mapping[str, Any], arch: str, fields: Mapping[str, Any], path: str
    ) -> dict[str, Any]:
        # the converter writes rope.scaling.original_context_length for every Phi-3 (4096 in the 4k
        # models); LongRoPE files also carry attn_factor and rope_factors_{long,short} tensors (those
        # tensors are refused by the loader as unread)
        if meta.get(f"{arch}.rope.scaling.attn_factor") is not None:
            raise ModelLoadError(path, "Phi-3 LongRoPE (rope.scaling.attn_factor) is not supported")
        return {}


ARCHITECTURE = Phi3()
