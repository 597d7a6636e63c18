"""The protocol between the executor, the model and a KV cache.

Ownership: the executor drives sequence lifetime through :class:`BatchControl`; the model reads and
writes K/V only through the :class:`KVStep` the executor hands it for one packed forward.

A packed step carries several sequences' tokens in one flat row order. Segment ``i`` covers the
packed rows ``[offset_i, offset_i + length_i)`` where offsets are the running sum of the lengths, in
the order the segments were given, and writes positions ``[start_i, start_i + length_i)`` of
sequence ``seq_i``. ``start_i`` must equal ``pos(seq_i)``: the executor rewinds first when it wants
to overwrite (``rewind`` refuses when the rows it needs are gone).

For each layer the model computes, for all packed rows,
    q: [T, q_heads, head_dim], k: [T, kv_heads, head_dim], v: [T, kv_heads, head_dim]
(RoPE already applied at each row's position), then calls ``step.views(layer, k, v)``. The cache
stores the new rows and returns :class:`KVView` groups covering every packed row exactly once. The
model attends each group's query rows to that view's keys/values under its mask (grouped-query
attention: q head ``h`` reads kv head ``h // (q_heads // kv_heads)``).

Every view (and part) also carries ``positions``: the absolute position each key row holds for the
view's sequence, -1 where the row is not the sequence's (another owner's cell, an unwritten slot). The
mask is exactly "position in [row position - window + 1, row position]" over those positions, so the
deterministic attention (``forkline_kernels.causal_attention``) reads them instead of the mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx


@dataclass(frozen=True)
class Segment:
    """One sequence's slice of a packed step: writes positions [start, start + length) of ``seq``."""

    seq: int
    start: int
    length: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.length < 1:
            raise ValueError(f"Segment needs start >= 0 and length >= 1, got {self}")


@dataclass(frozen=True)
class KVPart:
    """One contiguous piece of a multi-part view: keys, values [kv_heads, S_i, head_dim]; mask bool
    [rows, S_i] (True = attend) or None (every key of the part visible to every row); positions int32
    [S_i] (see the module docstring)."""

    keys: mx.array
    values: mx.array
    mask: mx.array | None
    positions: mx.array | None = None


@dataclass(frozen=True)
class KVView:
    """Keys/values that query rows ``rows`` (a slice of the packed rows) attend to.

    keys, values: [kv_heads, S, head_dim]
    mask: bool [rows, S] (True = attend), or the string "causal" (query row j of the group sits at key
        index S - n_rows + j and attends to keys 0..that index), or None (every key visible to every row).
    parts: when set, the view is these pieces instead (keys/values/mask are None): the rows attend the
        union of the parts' keys under one softmax, exactly as if the parts were concatenated. Lets a
        cache hand out a few pool slices without gathering them into one copy.
    positions: int32 [S], the absolute position of each key row for this view's sequence, -1 where the
        row is not readable (None in a multi-part view: each part has its own).
    """

    rows: slice
    keys: mx.array | None
    values: mx.array | None
    mask: mx.array | str | None
    parts: tuple[KVPart, ...] | None = None
    positions: mx.array | None = None

    def __post_init__(self) -> None:
        if self.parts is None:
            if self.keys is None or self.values is None:
                raise ValueError("KVView needs keys and values (or parts)")
        elif not self.parts or self.keys is not None or self.values is not None or self.mask is not None:
            raise ValueError("KVView parts must be non-empty and exclude keys/values/mask")


@runtime_checkable
class KVStep(Protocol):
    """One packed forward's access to the cache. Created by :meth:`BatchControl.begin_step`."""

    segments: Sequence[Segment]

    def views(self, layer: int, keys: mx.array, values: mx.array) -> Sequence[KVView]:
        """Store this step's rows for ``layer`` and return the views to attend.

        keys, values: [T, kv_heads, head_dim], packed in segment order (T = sum of lengths).
        Must be called once per layer, layers in any order.
        """
        ...

    def state(self) -> list[mx.array]:
        """The cache arrays this step produced; evaluate them with the logits to materialise the step."""
        ...


@runtime_checkable
class BatchControl(Protocol):
    """Sequence lifetime and admission, driven by the executor (engine thread only).

    Refusals return None/False and leave every sequence exactly as before. Misuse (unknown ids,
    bad positions) raises :class:`engine_service.api.errors.CacheError` or ``NotFound``.
    """

    @property
    def max_seqs(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Total token rows across all sequences."""
        ...

    def seq_new(self) -> int | None:
        """A new empty sequence id, or None when ``max_seqs`` are resident."""
        ...

    def seq_clone(self, src: int, upto: int) -> int | None:
        """A new sequence holding exactly positions [0, upto) of ``src`` with independent write
        ownership, or None (no slot, no room, boundary no longer available). Never changes ``src``."""
        ...

    def seq_rm(self, seq: int) -> None:
        """Release ``seq`` and its rows."""
        ...

    def rewind(self, seq: int, length: int) -> bool:
        """Set ``pos(seq) = length`` (<= current), or False when the rows it needs are gone."""
        ...

    def pos(self, seq: int) -> int:
        """Positions committed in ``seq`` (the next position to write)."""
        ...

    def can_admit(self, seq: int, n: int) -> bool:
        """Whether ``seq`` may append ``n`` positions in one step (capacity, max_write)."""
        ...

    def begin_step(self, segments: Sequence[Segment]) -> KVStep:
        """Reserve the rows for one packed step and advance each ``pos(seq)`` to ``start + length``.
        Raises CacheError when a segment is not admissible (check ``can_admit`` first)."""
        ...

    def clear(self) -> None:
        """Drop every sequence."""
        ...
