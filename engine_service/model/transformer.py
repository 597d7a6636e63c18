"""The decoder: embeddings, the architecture's layers, the final norm and the head, over one packed step
(several sequences' rows, each at its own position); K/V only through a :class:`KVStep`, activations
float32. Canonical names: ``embed``, ``norm``, ``lm_head`` (absent: tied), ``layers.i.*``."""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

import engine_service.model.fast_math as fast_math
from engine_service.cache.batch_control import KVStep
from engine_service.model.arch import architecture
from engine_service.model.config import ModelConfig
from engine_service.model.projections import NATIVE, Projection, Tensor, convert


class Transformer(nn.Module):
    """The decoder of ``config.architecture``."""

    def __init__(
        self, config: ModelConfig, tensors: Mapping[str, Tensor], weights_dtype: str = "float32"
    ) -> None:
        super().__init__()
        if weights_dtype == "auto":
            raise ValueError(
                "Transformer needs a resolved weights_dtype (float32/float16/bfloat16/quantized/q8_0/q4_1/native)"
            )
        arch = architecture(config.architecture)
        self._config = config
        # the embedding (and a tied head) stays 8-bit under q4_1, as GGUF's 4-bit files keep it (4 bits
        # there costs far more accuracy than in the layers)
        head_dtype = "q8_0" if weights_dtype == "q4_1" else weights_dtype
        self.embed_tokens = Projection(convert(tensors["embed"], head_dtype))
        self.layers = [arch.layer(config, i, tensors, weights_dtype) for i in range(config.num_layers)]
        kv_hint = [mx.float32]
        for layer in self.layers:
            layer.kv_hint = kv_hint  # one learned cache dtype for every layer
        self.norm = tensors["norm"].astype(mx.float32)
        self._embed_scale = arch.embed_scale(config)
        self._thetas = tuple(sorted({config.layer_rope_theta(i) for i in range(config.num_layers)}))
        # native: what each matrix kept, e.g. "q4_1" or "q4_1+q8_0" (Q4_K and Q5_0/Q6_K layers)
        self.weights_dtype = self._formats() if weights_dtype == NATIVE else weights_dtype
        if config.tie_embeddings or "lm_head" not in tensors:
            self.lm_head = None
        else:
            self.lm_head = Projection(convert(tensors["lm_head"], head_dtype))

    def _formats(self) -> str:
        formats = set()
        for layer in self.layers:
            for proj in (layer.qkv, layer.o, layer.gate_up, layer.down):
                formats.update(proj.format.split("+"))
        return "+".join(sorted(formats))

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def deterministic(self) -> bool:
        return self.layers[0].deterministic if self.layers else False

    def set_deterministic(self, on: bool) -> None:
        """Batch-invariant forwards; FailedPrecondition without the kernels or block weights."""
        if on:
            import engine_service.model.deterministic as deterministic

            deterministic.require(self.weights_dtype)
        for layer in self.layers:
            layer.deterministic = on
        for proj in self.modules():
            if isinstance(proj, Projection):  # SplitProjection parts are Projections too
                proj.kernel_only = on  # every row count through the batch-invariant kernel

    def embed(self, tokens: mx.array) -> mx.array:
        """tokens: int32 [T] -> float32 [T, hidden] (scaled as the architecture says)."""
        h = self.embed_tokens.rows(tokens)
        return h * self._embed_scale if self._embed_scale != 1.0 else h

    def __call__(
        self,
        step: KVStep,
        positions: mx.array,
        *,
        tokens: mx.array | None = None,
        embeddings: mx.array | None = None,
        logit_rows: mx.array | None = None,
    ) -> mx.array:
        """One packed forward: positions int32 [T]; tokens int32 [T] or embeddings float [T, hidden];
        logit_rows int32 [R] (None: all) -> float32 [R or T, vocab]."""
        if (tokens is None) == (embeddings is None):
            raise ValueError("Transformer needs exactly one of tokens / embeddings")
        h = self.embed(tokens) if tokens is not None else embeddings.astype(mx.float32)
        if h.ndim != 2 or h.shape[1] != self._config.hidden_size:
            raise ValueError(f"embeddings must be [T, {self._config.hidden_size}], got {h.shape}")
        if positions.shape != (h.shape[0],):
            raise ValueError(f"positions must be [{h.shape[0]}], got {positions.shape}")
        cfg = self._config
        rotations = {
            theta: fast_math.rope_tables(positions, cfg.head_dim, theta, cfg.rope_traditional)
            for theta in self._thetas
        }
        for layer in self.layers:
            h = layer(h, step, rotations, positions)
        if logit_rows is not None:
            h = h[logit_rows]
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if self.layers and self.layers[0].fuses(h.shape[0]) and head.fused_args() is not None:
            # the final norm inside the head's kernel, as every layer's pre-norm (one op, same rows)
            eps, first = self._config.rms_norm_eps, self.layers[0]
            panel = first.panel(h.shape[0])
            return first._fusion.fused_linear(h, *head.fused_args(), norm=self.norm, eps=eps, panel=panel)
        h = fast_math.rms_norm(self._config.rms_norm_eps)(h, self.norm)
        return head(h).astype(mx.float32)
