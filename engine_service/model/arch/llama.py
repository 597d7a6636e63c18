"""Llama (and Mistral, and every GGUF of ``general.architecture = llama``: SmolLM2, TinyLlama, ...).

Pre-norm attention and SwiGLU MLP, RoPE, optional sliding window on every layer (Mistral). GGUF's
converter permutes the Q/K rows of each head (the two rotary halves interleaved), so GGUF files run
traditional RoPE on them and Hugging Face folders the default one. Everything is the
:class:`~engine_service.model.arch.base.Architecture` default.
"""

from __future__ import annotations

from engine_service.model.arch.base import Architecture


class Llama(Architecture):
    name = "llama"
    gguf_names = ("llama",)
    hf_model_types = ("llama", "mistral")


ARCHITECTURE = Llama()
