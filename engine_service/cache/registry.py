"""Cache kinds by name: ``build_cache("batched-sequence", config) -> BatchControl``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from engine_service.api.errors import InvalidArgument
from engine_service.cache.batch_control import BatchControl
from engine_service.cache.batched_sequence import BatchedSequenceCache
from engine_service.cache.cell_cache import CellCache
from engine_service.cache.config import CacheConfig

_BUILDERS: Mapping[str, Callable[[CacheConfig], BatchControl]] = MappingProxyType(
    {
        "batched-sequence": BatchedSequenceCache,
        "batched-cell": CellCache,
    }
)


def cache_kinds() -> tuple[str, ...]:
    """The registered cache kind names."""
    return tuple(_BUILDERS)


def build_cache(kind: str, config: CacheConfig) -> BatchControl:
    """A new empty cache of ``kind``; InvalidArgument (listing the registered kinds) for an unknown name."""
    builder = _BUILDERS.get(kind) if isinstance(kind, str) else None
    if builder is None:
        raise InvalidArgument(f"cache_kind must be one of {', '.join(cache_kinds())}, got {kind!r}")
    if not isinstance(config, CacheConfig):
        raise InvalidArgument(f"config must be a CacheConfig, got {type(config).__name__}")
    return builder(config)
