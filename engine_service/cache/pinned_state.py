"""An idle sequence's K/V pinned for exports on any thread: :class:`PinnedState`.

Taken on the engine thread (``BatchedSequenceCache.pin_seq``) when a session is made that nothing
will write before it generates (a clone, an import): evaluated views of its buffers, no copy. A view
keeps its buffer's bytes as they were: MLX copies a buffer before writing into it while another array
shares it, so a later write to the sequence (a generation on it, which drops the pin first) copies
once instead of changing what the pin reads.

:meth:`PinnedState.state` then reads positions ``[0, upto)`` with numpy alone -- no MLX op, so no
graph is evaluated off the engine thread -- as :class:`~engine_service.cache.seq_state.SeqState`
arrays of :class:`StateTensor` (contiguous bytes, the layout ``SequenceCache.export`` gives: flat
layers and unwrapped rings hold rows ``[0, upto)``, a wrapped ring all its slots). Used by
``Session.export_async``: an idle snapshot's export never waits for the engine thread's running
forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from engine_service.cache.seq_state import SeqState, StateTensor


@runtime_checkable
class PinnableCache(Protocol):
    """A cache kind whose sequences pin without a copy (``batched-sequence``; ``batched-cell`` gathers
    its cells, so it would copy, and does not)."""

    def pin_seq(self, seq: int) -> PinnedState | None:
        """``seq``'s committed positions as views (engine thread); None: not exportable."""
        ...


@dataclass(frozen=True, eq=False)
class _PinnedArray:
    """One layer array: a numpy view of its evaluated rows; ``positional``: row p holds position p
    (a flat layer, a ring that never wrapped), so a prefix is its first rows."""

    view: np.ndarray  # [kv_heads, rows, head_dim], strided, sharing the buffer
    dtype: mx.Dtype
    positional: bool


class PinnedState:
    """Positions ``[0, length)`` of one sequence with high-water mark ``written``; a prefix may be
    read down to ``floor`` (a ring's rewind floor). Immutable; safe to read on any thread."""

    def __init__(self, state: SeqState, floor: int, positional: Mapping[str, bool]) -> None:
        """``state``: the sequence's export (evaluated [kv_heads, rows, head_dim] views of its
        buffers); ``positional``: per array, whether row p holds position p."""
        self.length, self.written, self.floor = state.length, state.written, floor
        # bfloat16 as uint16 views of the same bytes; evaluated here, on the engine thread
        raw = {n: a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for n, a in state.arrays.items()}
        mx.eval(list(raw.values()))
        # numpy reads the evaluated views without MLX (PEP 3118, strided, sharing the buffers)
        self._arrays = {
            n: _PinnedArray(np.asarray(raw[n]), a.dtype, positional[n]) for n, a in state.arrays.items()
        }

    def state(self, upto: int) -> SeqState | None:
        """Positions ``[0, upto)`` (contiguous copies), or None when ``upto`` is past the length or
        below the floor (a wrapped ring no longer holds the rows before it)."""
        if not self.floor <= upto <= self.length:
            return None
        arrays = {}
        for name, pinned in self._arrays.items():
            view = pinned.view[:, :upto, :] if pinned.positional else pinned.view
            data = np.ascontiguousarray(view)
            arrays[name] = StateTensor(tuple(data.shape), pinned.dtype, data)
        return SeqState(upto, self.written, arrays)
