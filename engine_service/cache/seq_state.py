"""One sequence's K/V out of a cache and back (:class:`SeqState`): a layout each kind owns, imported only
into the same kind and geometry (:func:`geometry_text`, recorded in snapshots), checked by
:func:`layout_problem` before anything enters the cache."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from engine_service.cache.config import CacheConfig


@dataclass(frozen=True)
class SeqState:
    """One sequence's K/V as its kind exports it (evaluated): ``length`` positions, high-water mark
    ``written`` (>= length; a ring keeps rows up to it), the kind's named ``arrays``."""

    length: int
    written: int
    arrays: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not 0 <= self.length <= self.written:
            raise ValueError(f"SeqState needs 0 <= length <= written, got {self.length}, {self.written}")

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


@dataclass(frozen=True, eq=False)
class StateTensor:
    """One array as raw little-endian bytes (numpy, C contiguous; uint16 for bfloat16) and its MLX
    shape / dtype: what a snapshot reader parses and a pinned export reads off the engine thread."""

    shape: tuple[int, ...]
    dtype: mx.Dtype
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def copy_raw(self) -> mx.array:
        """An ``mx.array`` copy of the bytes (uint16 for bfloat16): no MLX op, any thread."""
        return mx.array(self.data.reshape(self.shape))

    def to_mlx(self, raw: mx.array | None = None) -> mx.array:
        """A lazy ``mx.array`` of the tensor (``raw``: its :meth:`copy_raw`); needs an MLX stream."""
        a = self.copy_raw() if raw is None else raw
        return a.view(mx.bfloat16) if self.dtype == mx.bfloat16 else a


@runtime_checkable
class StateTransfer(Protocol):
    """What a cache kind adds to BatchControl to export and import one sequence (engine thread)."""

    def export_seq(self, seq: int, upto: int) -> SeqState | None:
        """Positions ``[0, upto)`` of ``seq``, or None when the rows they need are gone."""
        ...

    def state_problem(self, state: SeqState) -> str | None:
        """Why ``state`` does not fit this cache's layout, or None."""
        ...

    def import_seq(self, state: SeqState) -> int | None:
        """A new sequence holding ``state`` (its layout checked first), or None: no slot or room."""
        ...


def geometry_text(config: CacheConfig) -> str:
    """What an exported state's layout depends on, as one canonical line (recorded, then compared)."""
    layers = ",".join("full" if not spec.sliding else f"sliding:{spec.window}" for spec in config.layers)
    return (
        f"layers={layers};max_write={config.max_write};kv_heads={config.kv_heads};"
        f"head_dim={config.head_dim};dtype={dtype_name(config.dtype)}"
    )


def dtype_name(dtype: mx.Dtype) -> str:
    """``float32`` for ``mx.float32`` (the name without the module prefix)."""
    return str(dtype).rpartition(".")[2]


def layout_problem(state: SeqState, expected: Mapping[str, tuple[tuple[int, ...], mx.Dtype]]) -> str | None:
    """What differs between ``state.arrays`` and ``expected`` (name -> (shape, dtype)), or None."""
    names, want = set(state.arrays), set(expected)
    if names != want:
        missing, extra = sorted(want - names), sorted(names - want)
        return f"arrays differ: missing {missing}, unexpected {extra}"
    for name, (shape, dtype) in sorted(expected.items()):
        got = state.arrays[name]
        if tuple(got.shape) != tuple(shape) or got.dtype != dtype:
            return (
                f"array {name} is {list(got.shape)} {dtype_name(got.dtype)}, expected {list(shape)} "
                f"{dtype_name(dtype)}"
            )
    return None
