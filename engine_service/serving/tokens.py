"""Bearer tokens as plain code (no grpc): the token table and single-token files.

A token file holds one ``token owner`` pair a line (``#`` comments, blank lines skipped); a token is
16..512 characters without whitespace, listed once; an owner may have several (rotation).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import signal
import threading
from pathlib import Path

from engine_service.api.errors import InvalidArgument
from engine_service.api.owners import MAX_OWNER_LENGTH

log = logging.getLogger(__name__)

MIN_TOKEN_LENGTH = 16
MAX_TOKEN_LENGTH = 512


def check_token(token: str, what: str) -> str:
    """A token as a file or a header may carry it, else InvalidArgument naming ``what``."""
    if len(token) < MIN_TOKEN_LENGTH:
        raise InvalidArgument(
            f"{what}: a token must be at least {MIN_TOKEN_LENGTH} characters, got {len(token)}"
        )
    if len(token) > MAX_TOKEN_LENGTH:
        raise InvalidArgument(
            f"{what}: a token must be at most {MAX_TOKEN_LENGTH} characters, got {len(token)}"
        )
    if any(c.isspace() or not c.isprintable() for c in token):
        raise InvalidArgument(f"{what}: a token must not contain whitespace or control characters")
    return token


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def parse_token_file(text: str, path: str) -> tuple[tuple[bytes, str], ...]:
    """The (sha256 digest, owner) entries of a token file's ``text``; InvalidArgument ``path:line: ...``."""
    entries: list[tuple[bytes, str]] = []
    first_line: dict[bytes, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        fields = line.split()
        if len(fields) != 2:
            raise InvalidArgument(f"{where}: expected 'token owner', got {len(fields)} field(s)")
        token, owner = fields
        check_token(token, where)
        if len(owner) > MAX_OWNER_LENGTH:
            raise InvalidArgument(
                f"{where}: an owner must be 1..{MAX_OWNER_LENGTH} characters, got {len(owner)}"
            )
        digest = _digest(token)
        if digest in first_line:
            raise InvalidArgument(f"{where}: this token is already listed on line {first_line[digest]}")
        first_line[digest] = number
        entries.append((digest, owner))
    return tuple(entries)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read the token file ({exc})") from None


class TokenTable:
    """Tokens -> owners, from a token file (see the module docstring). Thread-safe: a reload swaps the
    whole table at once; lookups never see half of one."""

    def __init__(self, path: str, entries: tuple[tuple[bytes, str], ...]) -> None:
        self.path = path
        self._entries = entries
        self._lock = threading.Lock()  # one reload at a time

    @classmethod
    def load(cls, path: str) -> TokenTable:
        """Read ``path``; InvalidArgument naming the file (and line) when it cannot be used."""
        entries = parse_token_file(_read(path), path)
        if not entries:
            raise InvalidArgument(f"{path}: the token file lists no tokens")
        return cls(path, entries)

    def __len__(self) -> int:
        return len(self._entries)

    def owners(self) -> frozenset[str]:
        return frozenset(owner for _, owner in self._entries)

    def reload(self) -> bool:
        """Re-read the file; True when the new table is in use. A bad file (or an empty one) keeps the
        old table and logs an error naming the problem."""
        with self._lock:
            try:
                entries = parse_token_file(_read(self.path), self.path)
                if not entries:
                    raise InvalidArgument(f"{self.path}: the token file lists no tokens")
            except InvalidArgument as exc:
                log.error(
                    "token file not reloaded, keeping the previous %d tokens: %s", len(self._entries), exc
                )
                return False
            self._entries = entries
        log.info("token file %s reloaded: %d tokens", self.path, len(entries))
        return True

    def owner_for(self, token: str) -> str | None:
        """The owner of ``token``, or None. Constant time in the token's content: every entry is
        compared (``hmac.compare_digest`` over equal-length SHA-256 digests), no early exit."""
        digest = _digest(token)
        found: str | None = None
        for entry_digest, owner in self._entries:
            if hmac.compare_digest(entry_digest, digest) and found is None:
                found = owner
        return found


def reload_on_sighup(table: TokenTable) -> None:
    """Re-read ``table``'s file whenever the process gets SIGHUP (call from the main thread)."""
    signal.signal(signal.SIGHUP, lambda *_: table.reload())


def read_token_file(path: str, what: str = "token file") -> str:
    """The one token a file holds (surrounding whitespace stripped), e.g. a client's or the prefix
    service's token for the engine; InvalidArgument naming ``path`` when it is not exactly one token."""
    text = _read(path).strip()
    if not text:
        raise InvalidArgument(f"{path}: the {what} is empty")
    return check_token(text, path)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.1``, ``::1``, ``[::1]``)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
