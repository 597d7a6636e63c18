"""The protocol between the executor, the model and a KV cache: the executor drives sequences through
:class:`BatchControl`; the model reads and writes K/V only through one packed step's :class:`KVStep`
(segments in order, each writing ``[start, start + length)`` of its sequence at ``start == pos(seq)``).
Spec: docs/ENGINE.md (The KV cache: the protocol)."""

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
    """One piece of a multi-part view: keys, values [kv_heads, S_i, head_dim]; mask bool [rows, S_i] or
    None (all visible); positions int32 [S_i]."""

    keys: mx.array
    values: mx.array
    mask: mx.array | None
    positions: mx.array | None = None


@dataclass(frozen=True)
class KVView:
    """What query ``rows`` (a slice of the packed rows) attend: keys, values [kv_heads, S, head_dim];
    mask bool [rows, S] (True = attend), "causal" (row j at key S - rows + j) or None; ``parts``: pieces
    attended under one softmax instead; positions int32 [S]: each key's position, -1 where not readable."""

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


@dataclass(frozen=True)
class LayerIO:
    """A layer's K/V store and views as one layer op takes them (docs/ENGINE.md: The protocol)."""

    keys: list[mx.array]
    values: list[mx.array]
    writes: list[tuple[int, int, int, int]]
    parts: list[tuple]
    groups: list[tuple[int, int, int]]


@runtime_checkable
class KVStep(Protocol):
    """One packed forward's access to the cache. Created by :meth:`BatchControl.begin_step`."""

    segments: Sequence[Segment]

    def views(self, layer: int, keys: mx.array, values: mx.array) -> Sequence[KVView]:
        """Store keys, values [T, kv_heads, head_dim] (segment order) for ``layer``; the views covering
        every packed row once. Once per layer."""
        ...

    def state(self) -> list[mx.array]:
        """The cache arrays this step produced; evaluate them with the logits to materialise the step."""
        ...


@runtime_checkable
class BatchControl(Protocol):
    """Sequence lifetime and admission (engine thread). Refusals return None/False and change nothing;
    misuse raises CacheError or NotFound."""

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
        """A new sequence holding exactly ``[0, upto)`` of ``src``, or None. Never changes ``src``."""
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
        """Reserve one packed step's rows and advance each ``pos(seq)``; CacheError when not admissible."""
        ...

    def clear(self) -> None:
        """Drop every sequence."""
        ...
