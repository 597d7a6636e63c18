"""One sequence's K/V taken out of a cache and put back: :class:`SeqState`, and the checks an import
makes before anything enters the cache.

A cache kind exports a sequence as named arrays whose layout is its own (``batched-sequence`` keeps
ring layers as their physical slots, ``batched-cell`` gathers its cells in position order), so a state
is only ever imported into a cache of the same kind and geometry: :func:`geometry_text` is the
canonical text of everything the layout depends on (layer kinds and windows, ``max_write``, the K/V
row shape and dtype), which a snapshot file records and a load compares.

Arrays are anything with ``shape`` and ``dtype`` (an ``mx.array``, or a file's tensor on its way in);
:func:`layout_problem` compares them with what the kind expects and says what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from engine_service.cache.config import CacheConfig


@dataclass(frozen=True)
class SeqState:
    """One sequence's K/V as its cache kind exports it (engine thread; arrays evaluated).

    length: committed positions the state holds. written: the high-water mark (``>= length``; ring
    layers of a ``batched-sequence`` state keep rows up to it). arrays: the kind's named arrays.
    """

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
    """One array as raw little-endian bytes, out of MLX: ``data`` is numpy, C contiguous (uint16 for
    bfloat16, which numpy lacks; flat or shaped), ``shape`` / ``dtype`` say what it is (the MLX
    dtype). What a snapshot file's reader parses and what a pinned export reads off the engine thread."""

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
        """A lazy ``mx.array`` of the tensor (``raw``: its :meth:`copy_raw` made already); the
        bfloat16 view is an MLX op, so call this on a thread with an MLX stream."""
        a = self.copy_raw() if raw is None else raw
        return a.view(mx.bfloat16) if self.dtype == mx.bfloat16 else a


@runtime_checkable
class StateTransfer(Protocol):
    """What a cache kind adds to :class:`~engine_service.cache.batch_control.BatchControl` to export
    and import one sequence (engine thread only). Both registered kinds implement it."""

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
