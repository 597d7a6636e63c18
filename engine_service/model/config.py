"""Model hyper-parameters and the per-layer attention pattern (full or sliding window)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.api.checks import checked_float, checked_int
from engine_service.api.errors import InvalidArgument
from engine_service.api.limits import check_tokens
from engine_service.cache.config import FULL, SLIDING, LayerSpec


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    layers: tuple[LayerSpec, ...] = ()  # one per layer: full or sliding (the cache's geometry)
    context_length: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_traditional: bool = False  # adjacent pairs (GGUF's permuted Llama Q/K), else the two halves
    architecture: str = "llama"  # the engine_service.model.arch module that builds the layers
    rope_local_theta: float | None = None  # the sliding layers' RoPE base when it differs (Gemma 3)
    attn_scale: float | None = None  # None: head_dim ** -0.5

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "context_length",
        ):
            checked_int(f"ModelConfig.{name}", getattr(self, name), lo=1)
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgument(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgument(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layers) != self.num_layers:
            raise InvalidArgument(
                f"ModelConfig.layers must have num_layers={self.num_layers} entries, got {len(self.layers)}"
            )
        for name in ("rope_theta", "rms_norm_eps", "rope_local_theta", "attn_scale"):
            value = getattr(self, name)
            if value is not None or name in ("rope_theta", "rms_norm_eps"):  # the last two are optional
                checked_float(f"ModelConfig.{name}", value, lo=0.0, lo_open=True)
        special = (() if self.bos_token_id is None else (self.bos_token_id,)) + tuple(self.eos_token_ids)
        check_tokens(special, self.vocab_size, "ModelConfig special token ids (bos, eos...)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_rope_theta(self, index: int) -> float:
        """The RoPE base of layer ``index``: ``rope_local_theta`` on sliding layers when set."""
        if self.rope_local_theta is not None and self.layers[index].sliding:
            return self.rope_local_theta
        return self.rope_theta


def parse_layer_pattern(pattern: str, window: int | None) -> tuple[LayerSpec, ...]:
    """``"FRFR"`` -> LayerSpecs: ``F`` full, ``R`` or ``S`` sliding with ``window`` positions."""
    specs = []
    for ch in pattern.upper():
        if ch == "F":
            specs.append(LayerSpec(FULL))
        elif ch in ("R", "S"):
            specs.append(LayerSpec(SLIDING, window))
        else:
            raise InvalidArgument(f"layer pattern {pattern!r}: use F (full) and R/S (sliding), got {ch!r}")
    if not specs:
        raise InvalidArgument("layer pattern must not be empty")
    return tuple(specs)


def layer_specs(
    num_layers: int,
    sliding_window: int | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window_pattern: int | None = None,
) -> tuple[LayerSpec, ...]:
    """Per-layer attention kinds from ``layer_types``, else ``sliding_window_pattern`` N (every N-th layer
    full), else ``sliding_window`` (every layer slides); no window (None or <= 0): all full."""
    if not sliding_window or sliding_window <= 0:
        if layer_types and any(t == "sliding_attention" for t in layer_types):
            raise InvalidArgument("layer_types names sliding layers but sliding_window is not set")
        return tuple(LayerSpec(FULL) for _ in range(num_layers))
    if layer_types:
        if len(layer_types) != num_layers:
            raise InvalidArgument(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        specs = []
        for kind in layer_types:
            if kind == "sliding_attention":
                specs.append(LayerSpec(SLIDING, sliding_window))
            elif kind == "full_attention":
                specs.append(LayerSpec(FULL))
            else:
                raise InvalidArgument(f"layer_types: unsupported attention kind {kind!r}")
        return tuple(specs)
    if sliding_window_pattern:
        n = int(sliding_window_pattern)
        return tuple(
            LayerSpec(FULL) if (i + 1) % n == 0 else LayerSpec(SLIDING, sliding_window)
            for i in range(num_layers)
        )
    return tuple(LayerSpec(SLIDING, sliding_window) for _ in range(num_layers))
