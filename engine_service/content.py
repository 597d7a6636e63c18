"""What a session's committed positions hold, and its digest: the engine's answer to "does session S
hold exactly these tokens up to p" (DESIGN.md section 4: the engine, not the caller, is the authority
on what a session holds).

- :data:`PREPARED` is the content value of a position fed by a prepared input (embeddings...). Token
  ids are never negative, so it never equals one; a prepared input has no token identity, so a range
  holding one has no token digest and is never stored in a prefix cache (keys are token ids only).
- :func:`content_digest` hashes token ids: BLAKE2b, 16 bytes, personalized ``forkline-cont-v1``, over
  the ids as little-endian int32. The engine (over what a session holds) and the prefix service (over
  the tokens a caller names) compute the same function, so equal digests mean equal token sequences.
- :class:`ContentLog` is one session's record, kept by the engine thread (``SessionRecord.content``):
  ``len(log) == position`` always, rewinds truncate it, clones copy a prefix.

Cost: hashing 2,000 token ids is tens of microseconds (packing Python ints dominates; a ContentLog is
already packed, so its digest is the hash alone).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

import numpy as np

from engine_service.errors import InvalidArgument

PREPARED = -1
DIGEST_SIZE = 16
_PERSON = b"forkline-cont-v1"
_INT32 = "i"  # array typecode of a C int: 4 bytes on every platform MLX runs on
_NATIVE_LE = sys.byteorder == "little" and array(_INT32).itemsize == 4


def _packed(ids: Sequence[int]) -> bytes | array:
    """``ids`` as little-endian int32 bytes (an int32 array on a little-endian host is used as is)."""
    if _NATIVE_LE and isinstance(ids, array) and ids.typecode == _INT32:
        return ids
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise InvalidArgument(f"content ids must be int32 values: {exc}") from None


def content_digest(ids: Sequence[int]) -> bytes:
    """The 16-byte content digest of ``ids`` (token ids, or a ContentLog's values).

    InvalidArgument when an id is not an int32 (such ids are no session's content).
    """
    return hashlib.blake2b(_packed(ids), digest_size=DIGEST_SIZE, person=_PERSON).digest()


def check_digest(value: bytes, field: str) -> bytes | None:
    """A digest field as sent by a caller: empty -> None, else exactly DIGEST_SIZE bytes."""
    if not value:
        return None
    if len(value) != DIGEST_SIZE:
        raise InvalidArgument(f"{field} must be empty or {DIGEST_SIZE} bytes, got {len(value)}")
    return bytes(value)


class ContentLog:
    """The values of a session's committed positions: token ids, :data:`PREPARED` for prepared ones.

    Written only by the engine thread. Readers on other threads get consistent copies: each read
    copies the array in one step (atomic under the GIL), so it sees the log before or after an
    update, never half of one.
    """

    __slots__ = ("_ids",)

    def __init__(self, ids: array | None = None) -> None:
        self._ids = ids if ids is not None else array(_INT32)

    def __len__(self) -> int:
        return len(self._ids)

    def commit(self, start: int, tokens: Sequence[int] | None, size: int) -> None:
        """Positions ``[start, start + size)`` now hold ``tokens`` (None: a prepared input). A start
        below the end rewinds first (what the executor does)."""
        del self._ids[start:]
        if tokens is None:
            self._ids.extend(array(_INT32, (PREPARED,)) * size)
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
        """The content digest of ``[0, upto)`` (all when None); None when a prepared input lies in
        that range. InvalidArgument when ``upto`` is outside ``[0, len)``."""
        data = self._ids[:] if upto is None else self._ids[:upto]  # one atomic copy
        if upto is not None and (upto < 0 or len(data) != upto):
            raise InvalidArgument(f"upto={upto} is outside [0, {len(self._ids)}]")
        if data and int(np.frombuffer(data, dtype=np.int32).min()) < 0:
            return None
        return content_digest(data)

    def __repr__(self) -> str:
        return f"ContentLog({len(self._ids)} positions)"
