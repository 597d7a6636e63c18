"""Cache geometry: which layers keep full history and which keep a sliding window."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument

FULL = "full"
SLIDING = "sliding"
# ring slots beyond window + max_write - 1: the rows a step may write and still be taken back exactly
RING_SPARE = 1


@dataclass(frozen=True)
class LayerSpec:
    """Attention of one layer: ``full`` sees every earlier position; ``sliding`` sees ``q - window < p <= q``."""

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
    """Everything a cache builder needs."""

    capacity: int  # token rows over all sequences
    max_seqs: int
    layers: tuple[LayerSpec, ...]  # one per transformer layer
    kv_heads: int  # K/V rows are [kv_heads, head_dim]
    head_dim: int
    dtype: mx.Dtype = mx.float32
    initial_capacity: int = 256  # rows a flat layer preallocates (and grows by)
    max_write: int = 512  # positions one step writes per sequence; rings keep ring_slots(window) slots
    # writes a step's K/V into several buffers in one op (forkline_kernels.kv_store; None: a slice update
    # each); not part of the geometry
    kv_store: Callable | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("capacity", "max_seqs", "kv_heads", "head_dim", "initial_capacity", "max_write"):
            checked_int(f"CacheConfig.{name}", getattr(self, name), lo=1)
        if not self.layers:
            raise InvalidArgument("CacheConfig.layers must not be empty")

    def ring_slots(self, window: int) -> int:
        """Slots of a ring layer: ``window + max_write - 1`` (a ``max_write`` step at the rewind floor
        still finds the window before it) + ``RING_SPARE`` (a one-row step taken back -- the decode
        lookahead discarded -- overwrote only a row below every position the floor allows)."""
        return window + self.max_write - 1 + RING_SPARE


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
