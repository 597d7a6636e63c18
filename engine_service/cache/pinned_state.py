"""An idle sequence's K/V pinned for exports on any thread (:class:`PinnedState`): evaluated views of its
buffers taken on the engine thread, read later with numpy alone (MLX copies a buffer before writing
into it while a view shares it). Spec: docs/SNAPSHOTS.md (Export and import)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from engine_service.cache.seq_state import SeqState, StateTensor


@runtime_checkable
class PinnableCache(Protocol):
    """A cache kind whose sequences pin without a copy (``batched-sequence``)."""

    def pin_seq(self, seq: int) -> PinnedState | None:
        """``seq``'s committed positions as views (engine thread); None: not exportable."""
        ...


@dataclass(frozen=True, eq=False)
class _PinnedArray:
    """Numpy views of one layer array's rows, in order; ``positional``: row p holds position p."""

    views: tuple[np.ndarray, ...]  # each [kv_heads, rows_i, head_dim], strided, sharing a buffer
    dtype: mx.Dtype
    positional: bool


class PinnedState:
    """Positions ``[0, length)`` of one sequence (mark ``written``), readable down to ``floor`` on any
    thread. Immutable."""

    def __init__(
        self,
        length: int,
        written: int,
        floor: int,
        arrays: Mapping[str, Sequence[mx.array]],
        positional: Mapping[str, bool],
    ) -> None:
        """``arrays``: per name, the pieces [kv_heads, rows_i, head_dim] whose rows, in order, are the
        exported array's (views of the buffers; one dtype per name)."""
        self.length, self.written, self.floor = length, written, floor
        # bfloat16 as uint16 views of the same bytes; evaluated here, on the engine thread
        raw = {n: [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in v] for n, v in arrays.items()}
        mx.eval([a for v in raw.values() for a in v])
        # numpy reads the evaluated views without MLX (PEP 3118, strided, sharing the buffers)
        self._arrays = {
            n: _PinnedArray(tuple(np.asarray(a) for a in raw[n]), v[0].dtype, positional[n])
            for n, v in arrays.items()
        }

    def state(self, upto: int) -> SeqState | None:
        """Positions ``[0, upto)`` (contiguous copies), or None past the length or below the floor."""
        if not self.floor <= upto <= self.length:
            return None
        arrays = {}
        for name, pinned in self._arrays.items():
            whole = pinned.views[0] if len(pinned.views) == 1 else np.concatenate(pinned.views, axis=1)
            data = np.ascontiguousarray(whole[:, :upto, :] if pinned.positional else whole)
            arrays[name] = StateTensor(tuple(data.shape), pinned.dtype, data)
        return SeqState(upto, self.written, arrays)
