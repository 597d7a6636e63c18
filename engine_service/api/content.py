"""Content digests: "does session S hold exactly these tokens up to p", computed alike by the engine
and the prefix service (BLAKE2b-128 of the ids as little-endian int32). :data:`PREPARED` (negative) marks
a position fed by a prepared input: a range holding one has no digest."""

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
    if _NATIVE_LE and isinstance(ids, array) and ids.typecode == INT32:
        return ids
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except struct.error as exc:
        raise InvalidArgument(f"content ids must be int32 values: {exc}") from None


def content_digest(ids: Sequence[int]) -> bytes:
    """The 16-byte digest of ``ids``; InvalidArgument when an id is not an int32."""
    return hashlib.blake2b(_packed(ids), digest_size=DIGEST_SIZE, person=_PERSON).digest()


def check_digest(value: bytes, field: str) -> bytes | None:
    """A digest field as sent by a caller: empty -> None, else exactly DIGEST_SIZE bytes."""
    if not value:
        return None
    if len(value) != DIGEST_SIZE:
        raise InvalidArgument(f"{field} must be empty or {DIGEST_SIZE} bytes, got {len(value)}")
    return bytes(value)
