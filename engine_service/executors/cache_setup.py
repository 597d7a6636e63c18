"""The KV cache a model's sessions get: one place decides its geometry (layer specs, K/V row shape,
``max_write``, dtype, preallocation), for the executors and :mod:`engine_service.greedy` alike."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import mlx.core as mx

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument, ResourceExhausted
from engine_service.cache.batch_control import BatchControl
from engine_service.cache.config import CacheConfig
from engine_service.executors.kv_memory import kv_bytes_per_position, kv_memory_mib, positions_bound
from engine_service.executors.options import DEFAULTS, KV_DTYPES
from engine_service.model.cpu_kernels import kernels

log = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1
_PREALLOCATE = 256  # rows a flat layer allocates per step for a sequence


def resolve_kv_dtype(kv_dtype: str | mx.Dtype) -> mx.Dtype:
    """A name of :data:`KV_DTYPES` or an mx dtype -> the K/V storage dtype. ``auto``: float16 where
    attention reads it as stored (the compiled CPU kernel, a GPU), else float32 (docs/MODELS.md)."""
    if isinstance(kv_dtype, mx.Dtype):
        if kv_dtype not in (mx.float16, mx.bfloat16, mx.float32):
            raise InvalidArgument(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype}")
        return kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise InvalidArgument(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if kv_dtype != "auto":
        return getattr(mx, kv_dtype)
    from engine_service.model.cpu_kernels import kernels
    from engine_service.model.formats.weights import gpu_available

    if gpu_available():
        return mx.float16
    ext = kernels()
    return mx.float16 if ext is not None and hasattr(ext, "causal_attention") else mx.float32


def session_tokens(max_session_tokens: int, model_config: Any) -> int:
    """``max_session_tokens`` (checked), at most the model's ``context_length`` (logged when capped)."""
    checked_int("max_session_tokens", max_session_tokens, lo=1)
    context = model_config.context_length
    if max_session_tokens > context:
        log.info("max_session_tokens %d capped at the model's context_length %d", max_session_tokens, context)
    return min(max_session_tokens, context)


def cache_config(
    model_config: Any,
    *,
    max_sessions: int,
    max_session_tokens: int,
    kv_dtype: str | mx.Dtype = DEFAULTS.kv_dtype,
    max_write: int = DEFAULTS.prefill_chunk,
    kv_memory: int = DEFAULTS.kv_memory_mib,
) -> CacheConfig:
    """The geometry for ``max_sessions`` sessions of ``max_session_tokens`` positions, holding as many
    positions in all as ``kv_memory`` MiB of K/V (0: auto, :mod:`.kv_memory`); InvalidArgument for a
    bad limit, a capacity past int32 positions, sessions longer than the model's context, or a budget
    smaller than one session."""
    checked_int("max_sessions", max_sessions, lo=1)
    checked_int("max_session_tokens", max_session_tokens, lo=1)
    checked_int("max_write", max_write, lo=1)
    memory = kv_memory_mib(kv_memory)
    capacity = max_sessions * max_session_tokens
    if capacity > _INT32_MAX:
        raise InvalidArgument(
            f"max_sessions * max_session_tokens = {capacity} overflows the cache's int32 positions"
        )
    if max_session_tokens > model_config.context_length:
        raise InvalidArgument(
            f"max_session_tokens={max_session_tokens} exceeds the model's context_length={model_config.context_length}"
        )
    try:
        config = CacheConfig(
            capacity=capacity,
            max_seqs=max_sessions,
            layers=tuple(model_config.layers),
            kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=resolve_kv_dtype(kv_dtype),
            initial_capacity=min(_PREALLOCATE, max_session_tokens),
            max_write=max_write,
            kv_store=getattr(kernels(), "kv_store", None),
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    per_position = kv_bytes_per_position(config)
    bound = positions_bound(memory, per_position)
    if bound < max_session_tokens:
        raise InvalidArgument(
            f"kv_memory_mib={memory} holds {bound} positions of {per_position} bytes, fewer than one "
            f"session of max_session_tokens={max_session_tokens}"
        )
    return replace(config, capacity=min(capacity, bound))


def build_session_cache(cache_kind: str, config: CacheConfig) -> BatchControl:
    """A new empty cache of ``cache_kind`` for ``config``; InvalidArgument for an unknown kind,
    ResourceExhausted when the backend cannot hold it."""
    from engine_service.cache.registry import build_cache, cache_kinds

    if cache_kind not in cache_kinds():
        raise InvalidArgument(f"cache_kind must be one of {', '.join(cache_kinds())}, got {cache_kind!r}")
    limits = f"max_sessions={config.max_seqs} / capacity={config.capacity} positions"
    try:
        cache = build_cache(cache_kind, config)
    except InvalidArgument as exc:  # a known kind refusing the geometry: its own limits
        raise ResourceExhausted(f"{limits}: the {cache_kind} backend refused: {exc}") from exc
    if cache.max_seqs < config.max_seqs:
        raise ResourceExhausted(
            f"{limits}: exceeds the {cache_kind} backend's sequence limit {cache.max_seqs}"
        )
    if cache.capacity < config.capacity:
        raise ResourceExhausted(
            f"{limits}: {config.capacity} positions exceed the {cache_kind} backend's capacity {cache.capacity}"
        )
    return cache
