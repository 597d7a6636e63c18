"""What an architecture module provides, with the Llama-family defaults most share: its config from
GGUF metadata or ``config.json``, its tensor names in both formats, their shapes, its layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import mlx.core as mx

from engine_service.api.errors import ModelLoadError
from engine_service.model.config import ModelConfig, layer_specs
from engine_service.model.layers import DecoderLayer
from engine_service.model.projections import Tensor

GGUF, HF = "gguf", "hf"

# canonical layer tensor -> (GGUF name under blk.i., Hugging Face name under model.layers.i.); a name
# ending in "_bias" is the ".bias" of its projection, anything else a ".weight" (maybe quantized)
LAYER_NAMES: dict[str, tuple[str, str]] = {
    "attn_norm": ("attn_norm", "input_layernorm"),
    "q": ("attn_q", "self_attn.q_proj"),
    "k": ("attn_k", "self_attn.k_proj"),
    "v": ("attn_v", "self_attn.v_proj"),
    "qkv": ("attn_qkv", "self_attn.qkv_proj"),
    "q_bias": ("attn_q", "self_attn.q_proj"),
    "k_bias": ("attn_k", "self_attn.k_proj"),
    "v_bias": ("attn_v", "self_attn.v_proj"),
    "q_norm": ("attn_q_norm", "self_attn.q_norm"),
    "k_norm": ("attn_k_norm", "self_attn.k_norm"),
    "o": ("attn_output", "self_attn.o_proj"),
    "post_attn_norm": ("post_attention_norm", "post_attention_layernorm"),
    "mlp_norm": ("ffn_norm", "post_attention_layernorm"),
    "gate": ("ffn_gate", "mlp.gate_proj"),
    "up": ("ffn_up", "mlp.up_proj"),
    "gate_up": ("ffn_up", "mlp.gate_up_proj"),
    "down": ("ffn_down", "mlp.down_proj"),
    "post_mlp_norm": ("post_ffw_norm", "post_feedforward_layernorm"),
}
GLOBAL_NAMES: dict[str, tuple[str, str]] = {
    "embed": ("token_embd", "model.embed_tokens"),
    "norm": ("output_norm", "model.norm"),
    "lm_head": ("output", "lm_head"),
}


class LlamaLayer(DecoderLayer):
    """Pre-norm attention and MLP: h += attn(norm(h)); h += mlp(norm(h))."""

    def __call__(self, h: mx.array, step: Any, rotations: Any, positions: mx.array) -> mx.array:
        if self.fuses(h.shape[0]):
            return self.fused(h, step, rotations, positions)
        h = h + self.attention(self.norm(h, self.attn_norm), step, rotations, positions)
        return h + self.mlp(self.norm(h, self.mlp_norm))


class Architecture:
    """The Llama family's answers; an architecture module subclasses and overrides what differs."""

    name: ClassVar[str] = "llama"  # what ModelConfig.architecture holds
    gguf_names: ClassVar[tuple[str, ...]] = ("llama",)  # the registry's keys
    hf_model_types: ClassVar[tuple[str, ...]] = ("llama", "mistral")
    layer_tensors: ClassVar[tuple[str, ...]] = (
        "attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down",
    )  # fmt: skip
    layer_class: ClassVar[type[DecoderLayer]] = LlamaLayer
    activation: ClassVar[str] = "silu"
    # GGUF's Llama converter permutes Q/K rows per head (traditional RoPE); other architectures do not
    gguf_rope_traditional: ClassVar[bool] = True
    # added to every norm weight of a Hugging Face checkpoint (Gemma stores w - 1; its GGUF already w)
    hf_norm_offset: ClassVar[float] = 0.0
    # canonical -> (GGUF, HF) names where the files differ from LAYER_NAMES
    name_overrides: ClassVar[dict[str, tuple[str, str]]] = {}

    # ---- hyper-parameters
    def config_from_gguf(self, meta: Mapping[str, Any], path: str) -> ModelConfig:
        """A ModelConfig from ``{arch}.*`` metadata (``arch`` = the file's general.architecture)."""
        arch = meta.get("general.architecture")

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelLoadError(path, f"metadata key {arch}.{name} is missing")
            if isinstance(value, list):
                raise ModelLoadError(path, f"metadata key {arch}.{name} is per layer; not supported")
            return value

        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        n_layers = int(key("block_count"))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
        rope_dims = meta.get(f"{arch}.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise ModelLoadError(
                path, f"partial RoPE ({rope_dims} of {head_dim} dimensions) is not supported"
            )
        scaling = meta.get(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none") and float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) != 1.0:
            raise ModelLoadError(path, f"RoPE scaling {scaling!r} is not supported")
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
        window = meta.get(f"{arch}.attention.sliding_window")
        fields = dict(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            intermediate_size=int(key("feed_forward_length")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings=True,  # the loader corrects it once it knows whether output.weight exists
            layers=self.layer_pattern(n_layers, window, meta, path),
            context_length=int(key("context_length", 2048)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
            rope_traditional=self.gguf_rope_traditional,
            architecture=self.name,
        )
        fields.update(self.gguf_extra(meta, arch, fields, path))
        return _config(path, fields)

    def layer_pattern(self, n_layers: int, window: Any, meta: Mapping[str, Any], path: str) -> tuple:
        """Per-layer attention kinds from GGUF metadata (default: every layer slides when a window is set)."""
        return layer_specs(n_layers, int(window) if window else None)

    def gguf_extra(
        self, meta: Mapping[str, Any], arch: str, fields: Mapping[str, Any], path: str
    ) -> dict[str, Any]:
        """Architecture-specific ModelConfig fields from GGUF metadata (default: none)."""
        return {}

    def config_from_hf(self, cfg: Mapping[str, Any], path: str) -> ModelConfig:
        """A ModelConfig from a Hugging Face / MLX ``config.json``."""
        scaling = cfg.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ModelLoadError(path, f"rope_scaling {scaling!r} is not supported")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
                raise ModelLoadError(path, "partial RoPE (partial_rotary_factor) is not supported")
            eos = cfg.get("eos_token_id")
            fields = dict(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                num_layers=n_layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                intermediate_size=int(cfg["intermediate_size"]),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                layers=layer_specs(
                    n_layers,
                    cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
                    cfg.get("layer_types"),
                    cfg.get("sliding_window_pattern"),
                ),
                context_length=int(cfg.get("max_position_embeddings", 2048)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
                rope_traditional=False,
                architecture=self.name,
            )
            fields.update(self.hf_extra(cfg, fields))
        except KeyError as exc:
            raise ModelLoadError(path, f"config.json lacks {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(path, f"bad config.json: {exc}") from None
        return _config(path, fields)

    def hf_extra(self, cfg: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
        """Architecture-specific ModelConfig fields from config.json (default: none)."""
        return {}

    # ---- tensors
    def tensor_names(self, config: ModelConfig, fmt: str) -> dict[str, str]:
        """Canonical name -> the file's name (``fmt`` "gguf" or "hf"); ``lm_head`` is optional."""
        col = 0 if fmt == GGUF else 1
        names = {}
        for canon, pair in GLOBAL_NAMES.items():
            names[canon] = pair[col] + ".weight"
        for i in range(config.num_layers):
            prefix = f"blk.{i}." if fmt == GGUF else f"model.layers.{i}."
            for canon in self.layer_tensors:
                suffix = ".bias" if canon.endswith("_bias") else ".weight"
                pair = self.name_overrides.get(canon, LAYER_NAMES[canon])
                names[f"layers.{i}.{canon}"] = prefix + pair[col] + suffix
        return names

    def shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Canonical name -> its [out, in] (or [n]) shape."""
        c = config
        inter2 = 2 * c.intermediate_size
        per_layer = {
            "attn_norm": (c.hidden_size,), "mlp_norm": (c.hidden_size,),
            "post_attn_norm": (c.hidden_size,), "post_mlp_norm": (c.hidden_size,),
            "q": (c.q_size, c.hidden_size), "k": (c.kv_size, c.hidden_size), "v": (c.kv_size, c.hidden_size),
            "qkv": (c.q_size + 2 * c.kv_size, c.hidden_size),
            "q_bias": (c.q_size,), "k_bias": (c.kv_size,), "v_bias": (c.kv_size,),
            "q_norm": (c.head_dim,), "k_norm": (c.head_dim,),
            "o": (c.hidden_size, c.q_size),
            "gate": (c.intermediate_size, c.hidden_size), "up": (c.intermediate_size, c.hidden_size),
            "gate_up": (inter2, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
        }  # fmt: skip
        out = {
            "embed": (c.vocab_size, c.hidden_size),
            "norm": (c.hidden_size,),
            "lm_head": (c.vocab_size, c.hidden_size),
        }
        for i in range(c.num_layers):
            for canon in self.layer_tensors:
                out[f"layers.{i}.{canon}"] = per_layer[canon]
        return out

    def is_norm(self, canonical: str) -> bool:
        return canonical == "norm" or canonical.endswith("_norm")

    # ---- the model
    def layer(
        self, config: ModelConfig, index: int, tensors: Mapping[str, Tensor], weights_dtype: str
    ) -> DecoderLayer:
        return self.layer_class(config, index, tensors, weights_dtype, activation=self.activation)

    def embed_scale(self, config: ModelConfig) -> float:
        """Multiplies the token embeddings (not the tied head): 1 except where the architecture says."""
        return 1.0


def _config(path: str, fields: Mapping[str, Any]) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ModelLoadError(path, f"bad hyper-parameters: {exc}") from None
