"""Qwen2 and Qwen3: Llama-shaped, stored without the Q/K row permutation (default RoPE in GGUF too).

- Qwen2 (and Qwen2.5): a bias on the q, k and v projections.
- Qwen3: no bias; QK-norm, an RMS norm over each head's dimension of q and k before RoPE
  (``attn_q_norm`` / ``attn_k_norm``, [head_dim]); ``head_dim`` may differ from hidden / heads.
Sliding windows: Qwen2's config may set ``use_sliding_window`` (off in every released checkpoint).
"""

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
