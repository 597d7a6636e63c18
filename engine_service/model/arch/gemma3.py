"""Gemma 3 (text): a global layer every sixth (RoPE base 1e6; 1e4 on the sliding ones), QK-norm, sandwich
norms, GELU-tanh MLP, embeddings times sqrt(hidden), a tied head, scores scaled by query_pre_attn_scalar
** -0.5. Spec: docs/MODELS.md (Architectures)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from engine_service.model.arch.base import Architecture
from engine_service.model.config import ModelConfig, layer_specs
from engine_service.model.layers import DecoderLayer

GLOBAL_EVERY = 6
LOCAL_ROPE_THETA = 10000.0
_LAYERS_27B = 62


class Gemma3Layer(DecoderLayer):
    """h += post_attn_norm(attn(attn_norm(h))); h += post_mlp_norm(mlp(mlp_norm(h)))."""

    def __call__(self, h: mx.array, step: Any, rotations: Any, positions: mx.array) -> mx.array:
        if self.fuses(h.shape[0]):
            return self.fused(h, step, rotations, positions)
        a = self.attention(self.norm(h, self.attn_norm), step, rotations, positions)
        h = h + self.norm(a, self.post_attn_norm)
        m = self.mlp(self.norm(h, self.mlp_norm))
        return h + self.norm(m, self.post_mlp_norm)


class Gemma3(Architecture):
    name = "gemma3"
    gguf_names = ("gemma3",)
    hf_model_types = ("gemma3_text",)
    layer_tensors = (
        "attn_norm", "q", "k", "v", "q_norm", "k_norm", "o", "post_attn_norm",
        "mlp_norm", "gate", "up", "down", "post_mlp_norm",
    )  # fmt: skip
    name_overrides = {"mlp_norm": ("ffn_norm", "pre_feedforward_layernorm")}
    layer_class = Gemma3Layer
    activation = "gelu_tanh"
    gguf_rope_traditional = False
    hf_norm_offset = 1.0

    def layer_pattern(self, n_layers: int, window: Any, meta: Mapping[str, Any], path: str) -> tuple:
        return layer_specs(n_layers, int(window) if window else None, sliding_window_pattern=GLOBAL_EVERY)

    def gguf_extra(
        self, meta: Mapping[str, Any], arch: str, fields: Mapping[str, Any], path: str
    ) -> dict[str, Any]:
        local = float(meta.get(f"{arch}.rope.freq_base_swa", LOCAL_ROPE_THETA))
        return {"rope_local_theta": local, "attn_scale": _scale(fields)}

    def hf_extra(self, cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
        scalar = cfg.get("query_pre_attn_scalar")
        out: dict[str, Any] = {"rope_local_theta": float(cfg.get("rope_local_base_freq", LOCAL_ROPE_THETA))}
        out["attn_scale"] = float(scalar) ** -0.5 if scalar else _scale(fields)
        if cfg.get("sliding_window") and not cfg.get("layer_types") and not cfg.get("sliding_window_pattern"):
            out["layers"] = layer_specs(fields["num_layers"], int(cfg["sliding_window"]), None, GLOBAL_EVERY)
        if "tie_word_embeddings" not in cfg:
            out["tie_embeddings"] = True
        if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
            raise ValueError("logit soft-capping (Gemma 2) is not supported")
        return out

    def embed_scale(self, config: ModelConfig) -> float:
        return config.hidden_size**0.5


def _scale(fields: Mapping[str, Any]) -> float:
    if fields["num_layers"] == _LAYERS_27B:
        return (fields["hidden_size"] / fields["num_heads"]) ** -0.5
    return fields["head_dim"] ** -0.5


ARCHITECTURE = Gemma3()
