"""Phi-3 (mini / medium, 4k context): Llama-shaped with fused tensors, stored unpermuted.

``attn_qkv`` [q + k + v rows, hidden] (Hugging Face ``qkv_proj``) and ``ffn_up`` [2 * intermediate,
hidden] holding gate rows then up rows (``gate_up_proj``: SwiGLU of the first half times the second).
Phi-3 sets a sliding window on every layer (``phi3.attention.sliding_window``, 2047 in the 4k models).
The 128k variants' LongRoPE (``rope_factors_long`` / ``rope_scaling``) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine_service.errors import ModelLoadError
from engine_service.model.arch.base import Architecture


class Phi3(Architecture):
    name = "phi3"
    gguf_names = ("phi3",)
    hf_model_types = ("phi3",)
    layer_tensors = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")
    gguf_rope_traditional = False

    def gguf_extra(self, meta: Mapping[str, Any], arch: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        if meta.get(f"{arch}.rope.scaling.attn_factor") is not None or meta.get(
            f"{arch}.rope.scaling.original_context_length"
        ):
            raise ModelLoadError(str(meta.get("general.name", "phi3")), "Phi-3 LongRoPE is not supported")
        return {}


ARCHITECTURE = Phi3()
