"""Llama (Mistral, and every GGUF ``llama``: SmolLM2, TinyLlama, ...): the :class:`Architecture` defaults;
GGUF's permuted Q/K rows take traditional RoPE, Hugging Face folders the default one."""

from __future__ import annotations

from engine_service.model.arch.base import Architecture


class Llama(Architecture):
    name = "llama"
    gguf_names = ("llama",)
    hf_model_types = ("llama", "mistral")


ARCHITECTURE = Llama()
