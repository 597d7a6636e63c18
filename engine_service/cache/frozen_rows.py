"""Committed K/V rows of the flat layers that sequences share on ``batched-sequence``: a clone takes its
source's rows as :class:`FrozenRows` (views, never written again) instead of copying them, and every
sequence writes only its private tail. Spec: docs/ENGINE.md (The KV cache: batched-sequence)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import mlx.core as mx

# frozen pieces a sequence may hold before the smallest neighbours are merged (each piece is one more
# part of every flat layer's attention view)
MAX_PIECES = 8


class Block:
    """The identity of one allocation that frozen rows view (pieces trimmed from it share it)."""

    __slots__ = ()


@dataclass(frozen=True, eq=False)
class FrozenRows:
    """Positions ``[start, start + rows)`` of every flat layer: ``keys`` / ``values`` per layer, views
    [kv_heads, rows, head_dim] (None on ring layers and on layers never written); ``block`` names the
    allocation they view (from its row 0, so ``rows`` is what this piece holds of it)."""

    start: int
    rows: int
    keys: tuple[mx.array | None, ...]
    values: tuple[mx.array | None, ...]
    block: Block
    positions: mx.array  # int32 [rows]: start .. start + rows - 1

    @property
    def end(self) -> int:
        return self.start + self.rows

    def trimmed(self, end: int) -> FrozenRows:
        """This piece up to position ``end`` (start < end <= self.end), viewing the same block."""
        rows = end - self.start
        if rows == self.rows:
            return self
        return FrozenRows(
            self.start,
            rows,
            tuple(None if k is None else k[:, :rows, :] for k in self.keys),
            tuple(None if v is None else v[:, :rows, :] for v in self.values),
            self.block,
            self.positions[:rows],
        )


def without_layer(piece: FrozenRows, layer: int) -> FrozenRows:
    """``piece`` no longer viewing ``layer``'s rows (a layer its sequence now keeps as a ring)."""
    keys, values = list(piece.keys), list(piece.values)
    keys[layer] = values[layer] = None
    return FrozenRows(piece.start, piece.rows, tuple(keys), tuple(values), piece.block, piece.positions)


def freeze(
    start: int, rows: int, keys: Sequence[mx.array | None], values: Sequence[mx.array | None]
) -> FrozenRows:
    """Rows ``[0, rows)`` of buffers ``keys`` / ``values`` (per layer) as a new block at ``start``."""
    return FrozenRows(
        start,
        rows,
        tuple(None if k is None else k[:, :rows, :] for k in keys),
        tuple(None if v is None else v[:, :rows, :] for v in values),
        Block(),
        mx.arange(start, start + rows, dtype=mx.int32),
    )


def trim(pieces: tuple[FrozenRows, ...], end: int) -> tuple[FrozenRows, ...]:
    """The pieces covering positions ``[0, end)`` (the last one trimmed)."""
    return tuple(p.trimmed(min(p.end, end)) for p in pieces if p.start < end)


def coalesced(pieces: tuple[FrozenRows, ...], limit: int | None = None) -> tuple[FrozenRows, ...]:
    """``pieces`` with the smallest adjacent pairs merged (copies) until at most ``limit`` (default
    :data:`MAX_PIECES`) remain."""
    limit = MAX_PIECES if limit is None else limit
    out = list(pieces)
    while len(out) > limit:
        i = min(range(len(out) - 1), key=lambda j: out[j].rows + out[j + 1].rows)
        out[i : i + 2] = [_merge(out[i], out[i + 1])]
    return tuple(out)


def _merge(a: FrozenRows, b: FrozenRows) -> FrozenRows:
    def cat(x: mx.array | None, y: mx.array | None) -> mx.array | None:
        if x is None or y is None:
            return x if y is None else y
        return mx.concatenate([x, y], axis=1)

    keys = tuple(cat(x, y) for x, y in zip(a.keys, b.keys, strict=True))
    values = tuple(cat(x, y) for x, y in zip(a.values, b.values, strict=True))
    mx.eval([x for x in (*keys, *values) if x is not None])
    return freeze(a.start, a.rows + b.rows, keys, values)


def held_rows(pieces: Iterable[FrozenRows]) -> int:
    """Rows the distinct blocks behind ``pieces`` hold (a block counted once, at its longest piece)."""
    longest: dict[int, int] = {}
    for piece in pieces:
        key = id(piece.block)
        longest[key] = max(longest.get(key, 0), piece.rows)
    return sum(longest.values())
