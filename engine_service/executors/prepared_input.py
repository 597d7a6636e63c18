"""Prepared inputs: decoder positions computed outside the token embedding (e.g. a vision encoder), opaque
and immutable; ``kind()`` is an identity token (``accepts()`` from metadata alone), ``chunk(start, stop)``
a view sharing the owner's storage. Decode feedback after a prepared prefill is raw tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import mlx.core as mx

from engine_service.api.errors import InvalidArgument
from engine_service.api.limits import check_nonempty


class PreparedKind:
    """A type token: two inputs have the same kind iff ``a.kind() is b.kind()``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"PreparedKind({self.name!r})"


class PreparedInput(ABC):
    """Base class; subclasses set ``KIND`` to their own :class:`PreparedKind`."""

    KIND: ClassVar[PreparedKind]

    def kind(self) -> PreparedKind:
        return type(self).KIND

    @abstractmethod
    def size(self) -> int:
        """Decoder positions this input occupies."""

    @abstractmethod
    def chunk(self, start: int, stop: int) -> PreparedInput:
        """A view of positions [start, stop) sharing this input's storage."""


class EmbeddingsInput(PreparedInput):
    """Precomputed input embeddings, float [positions, hidden], fed in place of token embeddings."""

    KIND: ClassVar[PreparedKind] = PreparedKind("embeddings")

    __slots__ = ("_owner", "_start", "_stop")

    def __init__(self, embeddings: mx.array, *, _start: int = 0, _stop: int | None = None) -> None:
        if not isinstance(embeddings, mx.array) or embeddings.ndim != 2:
            raise InvalidArgument(
                "EmbeddingsInput.embeddings must be an mx.array of shape [positions, hidden]"
            )
        check_nonempty(embeddings.shape[0], "EmbeddingsInput.embeddings")
        stop = embeddings.shape[0] if _stop is None else _stop
        if not 0 <= _start < stop <= embeddings.shape[0]:
            raise ValueError(f"EmbeddingsInput view [{_start}, {stop}) is outside [0, {embeddings.shape[0]})")
        if _stop is None:
            # materialise on the caller's thread: MLX streams are per thread, so a lazy graph built
            # here cannot be evaluated later on the engine thread
            mx.eval(embeddings)
        self._owner = embeddings
        self._start = _start
        self._stop = stop

    @property
    def hidden_size(self) -> int:
        return self._owner.shape[1]

    @property
    def owner(self) -> mx.array:
        """The full storage this view shares ([positions, hidden])."""
        return self._owner

    def size(self) -> int:
        return self._stop - self._start

    def chunk(self, start: int, stop: int) -> EmbeddingsInput:
        if not 0 <= start < stop <= self.size():
            raise ValueError(f"chunk [{start}, {stop}) is outside [0, {self.size()})")
        return EmbeddingsInput(self._owner, _start=self._start + start, _stop=self._start + stop)

    def embeddings(self) -> mx.array:
        """The rows of this view: [size, hidden]."""
        return self._owner[self._start : self._stop]
