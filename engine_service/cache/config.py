"""Cache geometry: which layers keep full history and which keep a sliding window."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument

FULL = "full"
SLIDING = "sliding"


@dataclass(frozen=True)
class LayerSpec:
    """Attention kind of one transformer layer.

    ``kind == "full"``: attends to every earlier position. ``kind == "sliding"``: a query at position
    ``q`` attends to positions ``p`` with ``q - window < p <= q`` (``window`` positions including itself).
    """

    kind: str = FULL
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in (FULL, SLIDING):
            raise InvalidArgument(f"LayerSpec.kind must be 'full' or 'sliding', got {self.kind!r}")
        if self.kind == SLIDING:
            checked_int("LayerSpec.window", self.window, lo=1)
        if self.kind == FULL and self.window is not None:
            raise InvalidArgument("LayerSpec.window must be None for a full layer")

    @property
    def sliding(self) -> bool:
        return self.kind == SLIDING


@dataclass(frozen=True)
class CacheConfig:
    """Everything a cache builder needs.

    capacity: total token rows the cache may hold across all sequences (logical capacity).
    max_seqs: most sequences resident at once.
    layers: one LayerSpec per transformer layer.
    kv_heads, head_dim: K/V row shape is [kv_heads, head_dim].
    dtype: K/V storage dtype.
    initial_capacity: rows a flat layer preallocates for a new sequence (grows in steps of this).
    max_write: most positions one step may write for one sequence on a ring layer; ring layers keep
        ``window + max_write - 1`` physical slots.
    kv_store: the op that writes a step's new K/V rows into several buffers at once,
        ``kv_store(k, v, keys, values, writes) -> (keys, values)`` (``forkline_kernels.kv_store``, which
        the executor passes when the compiled kernels load; used on a CPU stream), or None: one MLX
        slice update per buffer. Not part of the geometry (equal configs may differ in it).
    """

    capacity: int
    max_seqs: int
    layers: tuple[LayerSpec, ...]
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype = mx.float32
    initial_capacity: int = 256
    max_write: int = 512
    kv_store: Callable | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("capacity", "max_seqs", "kv_heads", "head_dim", "initial_capacity", "max_write"):
            checked_int(f"CacheConfig.{name}", getattr(self, name), lo=1)
        if not self.layers:
            raise InvalidArgument("CacheConfig.layers must not be empty")


class ConfiguredCache:
    """The limits every BatchControl reads straight from its :class:`CacheConfig` (``self._cfg``)."""

    _cfg: CacheConfig

    @property
    def config(self) -> CacheConfig:
        return self._cfg

    @property
    def max_seqs(self) -> int:
        return self._cfg.max_seqs

    @property
    def capacity(self) -> int:
        """Total token rows across all sequences."""
        return self._cfg.capacity
