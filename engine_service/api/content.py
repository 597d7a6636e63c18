"""Content digests: the engine's answer to "does session S hold exactly these tokens up to p".

- :func:`content_digest` hashes token ids: BLAKE2b, 16 bytes, personalized ``forkline-cont-v1``, over
  the ids as little-endian int32. The engine (over what a session holds) and the prefix service (over
  the tokens a caller names) compute the same function: equal digests mean equal token sequences.
- :data:`PREPARED` is the content value of a position fed by a prepared input. Token ids are never
  negative, so it never equals one; a range holding one has no token digest.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from engine_service.api.errors import InvalidArgument

PREPARED = -1
DIGEST_SIZE = 16
INT32 = "i"  # array typecode of a C int: 4 bytes on every platform MLX runs on
_PERSON = b"forkline-cont-v1"
_NATIVE_LE = sys.byteorder == "little" and array(INT32).itemsize == 4


def _packed(ids: Sequence[int]) -> bytes | array:
    """``ids`` as little-endian int32 bytes (an int32 array on a little-endian host is used as is)."""
    if _NATIVE_LE and isinstance(ids, array) and ids.typecode == INT32:
        return ids
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise InvalidArgument(f"content ids must be int32 values: {exc}") from None


def content_digest(ids: Sequence[int]) -> bytes:
    """The 16-byte content digest of ``ids`` (token ids, or a session's content values).

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
