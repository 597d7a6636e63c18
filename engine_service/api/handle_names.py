"""Session handles as the wire carries them: ``"<instance id>.<32 hex digits>"``, 128 random bits
after the 16-hex-digit id of the engine instance that issued the handle (a restarted engine has a new
id, so a handle names the instance it belongs to)."""

from __future__ import annotations

import re
import secrets

HANDLE_RANDOM_BITS = 128
_INSTANCE_RE = re.compile(r"^[0-9a-f]{16}$")
_HANDLE_RE = re.compile(r"^([0-9a-f]{16})\.([0-9a-f]{32})$")


def new_instance_id() -> str:
    """A fresh random engine instance id: 64 bits as 16 lowercase hex digits."""
    return secrets.token_hex(8)


def is_instance_id(text: str) -> bool:
    return bool(_INSTANCE_RE.match(text))


def new_handle(instance_id: str) -> str:
    return f"{instance_id}.{secrets.token_hex(HANDLE_RANDOM_BITS // 8)}"


def handle_instance(handle: str) -> str | None:
    """The instance id a well-formed handle carries, or None for a malformed one."""
    match = _HANDLE_RE.match(handle)
    return match.group(1) if match else None
