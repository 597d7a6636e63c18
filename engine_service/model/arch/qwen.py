"""Qwen2 (q/k/v bias) and Qwen3 (QK-norm, ``head_dim`` of its own): Llama-shaped, stored unpermuted."""

from __future__ import annotations

from engine_service.model.arch.base import Architecture

_LLAMA_LAYER = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")


class Qwen2(Architecture):
    name = "qwen2"
    gguf_names = ("qwen2",)
    hf_model_types = ("qwen2",)
    layer_tensors = (*_LLAMA_LAYER, "q_bias", "k_bias", "v_bias")
    gguf_rope_traditional = False


class Qwen3(Architecture):
    name = "qwen3"
    gguf_names = ("qwen3",)
    hf_model_types = ("qwen3",)
    layer_tensors = (*_LLAMA_LAYER, "q_norm", "k_norm")
    gguf_rope_traditional = False


QWEN2 = Qwen2()
QWEN3 = Qwen3()
