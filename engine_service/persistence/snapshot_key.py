"""SnapshotKey: the secret that signs an engine's snapshot files with a keyed BLAKE2b-256 MAC
(``--snapshot_key FILE``); its repr, errors and logs name the file, never its contents.
Spec: docs/SNAPSHOTS.md (signed files).
"""

from __future__ import annotations

import hashlib
import os
import stat

from engine_service.api.errors import InvalidArgument

MAC_ALGORITHM = "blake2b-256-keyed"  # the value of a signed file's ``mac`` metadata field
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
_DERIVE_PERSON = b"forkline-key-v1"  # the MAC key is BLAKE2b-256(secret) under this personalization


class SnapshotKey:
    """A snapshot-signing key. Build it with :func:`read_snapshot_key` (or :meth:`from_secret`)."""

    __slots__ = ("_mac_key",)

    def __init__(self, mac_key: bytes) -> None:
        if len(mac_key) != 32:
            raise InvalidArgument("a snapshot MAC key is 32 bytes (use SnapshotKey.from_secret)")
        self._mac_key = mac_key

    @classmethod
    def from_secret(cls, secret: bytes) -> SnapshotKey:
        """The key of ``secret`` (InvalidArgument when it is shorter than MIN_SECRET_BYTES)."""
        if len(secret) < MIN_SECRET_BYTES:
            raise InvalidArgument(
                f"a snapshot key needs at least {MIN_SECRET_BYTES} bytes of secret, got {len(secret)}"
            )
        return cls(hashlib.blake2b(secret, digest_size=32, person=_DERIVE_PERSON).digest())

    def hasher(self, person: bytes) -> hashlib.blake2b:
        """A keyed BLAKE2b-256 under ``person``: feed it the signed bytes."""
        return hashlib.blake2b(digest_size=32, key=self._mac_key, person=person)

    def __repr__(self) -> str:
        return "SnapshotKey(<secret>)"

    __str__ = __repr__

    def __reduce__(self):  # never pickled into a log, a queue or another process by accident
        raise TypeError("a SnapshotKey is not serializable")


def read_snapshot_key(path: str | os.PathLike) -> SnapshotKey:
    """The key in ``path`` (its bytes, whitespace stripped); InvalidArgument naming the file when it is
    missing, too short or long, or loose: whoever can replace the key can sign files."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"{path}: the snapshot key is not a regular file")
        if info.st_mode & (stat.S_IROTH | stat.S_IWOTH | stat.S_IWGRP):
            raise InvalidArgument(
                f"{path}: the snapshot key file is readable or writable by others "
                f"(mode {stat.S_IMODE(info.st_mode):03o}); make it private: chmod 600 "
                f"(a Kubernetes secret: defaultMode 0400 or 0440)"
            )
        if info.st_size > MAX_SECRET_BYTES + 64:
            raise InvalidArgument(
                f"{path}: {info.st_size} bytes is too long for a snapshot key "
                f"(at most {MAX_SECRET_BYTES}); is it the right file?"
            )
        with open(path, "rb") as f:
            secret = f.read(MAX_SECRET_BYTES + 65).strip()
    except OSError as exc:
        raise InvalidArgument(
            f"{path}: cannot read the snapshot key ({exc.strerror or type(exc).__name__})"
        ) from None
    if len(secret) > MAX_SECRET_BYTES:
        raise InvalidArgument(f"{path}: the snapshot key is longer than {MAX_SECRET_BYTES} bytes")
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgument(
            f"{path}: the snapshot key has {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed "
            f'(e.g. python -c "import secrets; print(secrets.token_urlsafe(32))" > {path}; chmod 600 {path})'
        )
    return SnapshotKey.from_secret(secret)
