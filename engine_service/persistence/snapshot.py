"""A session taken out of the engine (:class:`SessionSnapshot`), valid for one engine configuration, and
the header checks a load makes against the engine that would hold it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np

from engine_service.api.content import content_digest
from engine_service.api.errors import InvalidArgument
from engine_service.api.limits import check_fits
from engine_service.api.snapshot_files import LoadRefusal, StateLayout
from engine_service.cache.seq_state import SeqState, StateTensor


@dataclass(frozen=True, eq=False)
class SessionSnapshot:
    """One session's committed positions, out of the engine, under the configuration it was taken in."""

    fingerprint: str
    layout: StateLayout
    state: SeqState  # the cache kind's arrays
    content: tuple[int, ...]  # the token id of each position
    # application strings (a namespace, entry metadata), covered by the file's checksum
    extra: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def positions(self) -> int:
        return self.state.length

    @property
    def content_digest(self) -> bytes:
        return content_digest(self.content)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def with_extra(self, extra: Mapping[str, str]) -> SessionSnapshot:
        """The same snapshot carrying ``extra`` (string keys and values)."""
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
            raise ValueError("extra must map strings to strings")
        return SessionSnapshot(
            self.fingerprint, self.layout, self.state, self.content, MappingProxyType(dict(extra))
        )


def header_refusal(
    snapshot: SessionSnapshot, fingerprint: str, layout: StateLayout | None, max_session_tokens: int
) -> tuple[LoadRefusal, str] | None:
    """Why ``snapshot`` cannot be loaded here (None: its header fits; the executor checks the arrays).
    The layout comes first, so the reason is specific (another cache kind or geometry)."""
    if layout is None:
        return LoadRefusal.UNSUPPORTED, "this engine's executor does not import sessions"
    if snapshot.layout.cache_kind != layout.cache_kind:
        return (
            LoadRefusal.CACHE_KIND,
            f"taken under cache kind {snapshot.layout.cache_kind!r}, this engine runs {layout.cache_kind!r}",
        )
    if snapshot.layout.geometry != layout.geometry:
        return (
            LoadRefusal.GEOMETRY,
            f"taken under geometry {snapshot.layout.geometry!r}, this engine has {layout.geometry!r}",
        )
    if snapshot.fingerprint != fingerprint:
        return (
            LoadRefusal.FINGERPRINT,
            f"taken under engine fingerprint {snapshot.fingerprint}, this engine is {fingerprint}",
        )
    try:
        check_fits(0, snapshot.positions, max_session_tokens, field="snapshot")
    except InvalidArgument as exc:
        return LoadRefusal.TOO_LONG, str(exc)
    if len(snapshot.content) != snapshot.positions or any(t < 0 for t in snapshot.content):
        return (
            LoadRefusal.CONTENT,
            f"content of {len(snapshot.content)} ids for {snapshot.positions} positions",
        )
    return None


def mlx_state(state: SeqState) -> SeqState:
    """``state`` with every array an ``mx.array`` (numpy arrays and :class:`StateTensor` are copied)."""
    if all(isinstance(a, mx.array) for a in state.arrays.values()):
        return state
    return SeqState(
        state.length,
        state.written,
        {name: _mlx(a) for name, a in state.arrays.items()},
    )


def _mlx(array: Any) -> mx.array:
    if isinstance(array, mx.array):
        return array
    return array.to_mlx() if isinstance(array, StateTensor) else mx.array(np.asarray(array))
