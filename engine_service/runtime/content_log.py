"""ContentLog: what one session's committed positions hold (token ids, ``PREPARED`` for prepared ones);
``len(log) == position``, rewinds truncate it, clones copy a prefix."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

from engine_service.api.content import INT32, PREPARED, content_digest
from engine_service.api.errors import InvalidArgument


class ContentLog:
    """Written by the engine thread only; each read elsewhere copies the array in one step (atomic
    under the GIL), so it sees an update whole or not at all."""

    __slots__ = ("_ids",)

    def __init__(self, ids: array | None = None) -> None:
        self._ids = ids if ids is not None else array(INT32)

    def __len__(self) -> int:
        return len(self._ids)

    def commit(self, start: int, tokens: Sequence[int] | None, size: int) -> None:
        """``[start, start + size)`` now hold ``tokens`` (None: prepared); a lower start rewinds first."""
        del self._ids[start:]
        if tokens is None:
            self._ids.extend(array(INT32, (PREPARED,)) * size)
        else:
            self._ids.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens (accepted speculative drafts)."""
        self._ids.extend(tokens)

    def prefix(self, upto: int) -> ContentLog:
        """A copy of positions ``[0, upto)`` (a clone's content)."""
        return ContentLog(self._ids[:upto])

    def values(self, upto: int | None = None) -> tuple[int, ...]:
        """The values of ``[0, upto)`` (all when None)."""
        return tuple(self._ids[:upto])

    def digest(self, upto: int | None = None) -> bytes | None:
        """The content digest of ``[0, upto)`` (None: a prepared input in range; InvalidArgument outside)."""
        data = self._ids[:] if upto is None else self._ids[:upto]  # one atomic copy
        if upto is not None and (upto < 0 or len(data) != upto):
            raise InvalidArgument(f"upto={upto} is outside [0, {len(self._ids)}]")
        if data and int(np.frombuffer(data, dtype=np.int32).min()) < 0:
            return None
        return content_digest(data)

    def __repr__(self) -> str:
        return f"ContentLog({len(self._ids)} positions)"
