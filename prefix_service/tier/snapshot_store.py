"""SnapshotStore: the folder of snapshot files (``--snapshot_dir``) indexed by (fingerprint, namespace,
tokens) from the files' headers; atomic writes, a byte budget evicted in the retention policy's
order, :meth:`match` for the longest stored prefix of a prompt. Thread-safe."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine_service.api.content import content_digest
from engine_service.api.errors import InvalidArgument
from engine_service.api.snapshot_files import (
    SUFFIX,
    TEMP_SUFFIX,
    SnapshotRefused,
    peek_snapshot,
    snapshot_name,
    write_snapshot_bytes,
)
from prefix_service.cache.candidate_walk import first_within_rewind
from prefix_service.cache.index import TokenIndex, token_key
from prefix_service.cache.retention import Entry, RetentionPolicy, frozen_metadata, make_policy

log = logging.getLogger(__name__)

NAMESPACE_KEY = "forkline.namespace"
TOKENS_KEY = "forkline.tokens"
METADATA_KEY = "forkline.metadata"
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class StoreStats:
    files: int
    bytes: int
    max_bytes: int
    written: int = 0
    dropped: int = 0  # the writer's queue was full
    failed: int = 0  # the engine refused the export or the handle was gone
    restored: int = 0  # into an engine
    refused: int = 0  # restores the engine refused
    evicted: int = 0  # for the byte budget
    discarded: int = 0  # refused for good (``persistent_tier.KEPT``: what is not)


@dataclass(frozen=True)
class DiskMatch:
    """The longest stored prefix of a prompt: the ``entry`` (its ``snapshot`` is the file name) and
    the positions a restore would let a lookup reuse (``reusable``)."""

    entry: Entry
    reusable: int


def extra_for(namespace: str, tokens: Sequence[int], metadata: Mapping[str, str]) -> dict[str, str]:
    """The ``extra`` strings a snapshot file of this entry carries (its key, for a rescan)."""
    return {
        NAMESPACE_KEY: namespace,
        TOKENS_KEY: json.dumps(list(tokens), separators=(",", ":")),
        METADATA_KEY: json.dumps(dict(metadata), sort_keys=True),
    }


class SnapshotStore:
    """See the module docstring. ``policy``: the retention policy's name or instance."""

    def __init__(
        self, folder: str | os.PathLike, max_bytes: int, policy: str | RetentionPolicy = "lru"
    ) -> None:
        if max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be >= 0, got {max_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.policy = make_policy(policy)
        self._lock = threading.Lock()
        self._index: TokenIndex[Entry] = TokenIndex()
        self._sizes: dict[str, int] = {}  # file name -> bytes
        self._entries: dict[str, Entry] = {}  # file name -> its entry
        self._scopes: dict[str, tuple[str, str]] = {}  # file name -> (fingerprint, namespace)
        self._clock = itertools.count(1)
        self._counts = dict.fromkeys(
            ("written", "dropped", "failed", "restored", "refused", "evicted", "discarded"), 0
        )
        self.scan()

    # -- reading the folder ------------------------------------------------------------------------
    def scan(self) -> int:
        """Index the folder's snapshot files, oldest first (the retention order follows their ages),
        deleting stale temporaries and foreign files; how many were indexed."""
        for temp in self.folder.glob(f".*{TEMP_SUFFIX}"):
            with contextlib.suppress(OSError):
                temp.unlink()
        paths = sorted(
            (p for p in self.folder.glob(f"*{SUFFIX}") if not p.name.startswith(".")),
            key=lambda p: p.stat().st_mtime_ns,
        )
        for path in paths:
            try:
                info = peek_snapshot(path)
                namespace = info.extra[NAMESPACE_KEY]
                tokens = token_key(json.loads(info.extra[TOKENS_KEY]))
                metadata = frozen_metadata(json.loads(info.extra[METADATA_KEY]))
                if len(tokens) != info.positions or content_digest(tokens).hex() != info.content_digest:
                    raise ValueError("its key does not match its content")
            except (SnapshotRefused, KeyError, ValueError, TypeError, InvalidArgument) as exc:
                log.warning("snapshot dir: deleting %s: %s", path.name, exc)
                self._unlink(path.name)
                continue
            self._add(path.name, info.fingerprint, namespace, tokens, metadata, info.file_bytes)
        self._evict_over_budget()
        return len(self._entries)

    def match(
        self, fingerprint: str, namespace: str, key: tuple[int, ...], max_rewind: int | None = None
    ) -> DiskMatch | None:
        """The longest stored prefix of ``key`` under ``fingerprint`` and ``namespace`` (on a ring:
        only one a clone can reach, ``max_rewind``), or None."""
        if len(key) < 2:
            return None
        with self._lock:
            found = first_within_rewind(
                self._index.matches((fingerprint, namespace), key), len(key), max_rewind
            )
        return None if found is None else DiskMatch(found[0].value, found[1])

    def holds(self, fingerprint: str, namespace: str, tokens: Sequence[int]) -> bool:
        with self._lock:
            return self._index.get((fingerprint, namespace), tuple(tokens)) is not None

    def recent(self, fingerprint: str, n: int) -> list[Entry]:
        """Up to ``n`` entries under ``fingerprint``, most recently used first."""
        with self._lock:
            mine = [e for name, e in self._entries.items() if self._scopes[name][0] == fingerprint]
        return sorted(mine, key=lambda e: e.last_used, reverse=True)[: max(0, n)]

    def usage(self, fingerprint: str) -> tuple[int, int]:
        """(files, bytes) under ``fingerprint``."""
        with self._lock:
            mine = [name for name, scope in self._scopes.items() if scope[0] == fingerprint]
            return len(mine), sum(self._sizes[name] for name in mine)

    def read(self, name: str) -> Iterator[bytes]:
        """The file's bytes in chunks (OSError when it is gone)."""
        with open(self.folder / name, "rb") as f:
            while data := f.read(CHUNK_BYTES):
                yield data

    # -- changing it -------------------------------------------------------------------------------
    def write(
        self,
        fingerprint: str,
        namespace: str,
        tokens: Sequence[int],
        metadata: Mapping[str, str],
        chunks: Iterable[bytes],
    ) -> bool:
        """Write this entry's file from ``chunks`` atomically; whether it is kept (a file over the whole
        budget is not). Errors of ``chunks`` propagate, leaving nothing behind."""
        key = token_key(tokens)
        name = snapshot_name(fingerprint, content_digest(key))
        size = write_snapshot_bytes(self.folder / name, b"".join(chunks))  # atomic: temp, fsync, rename
        with self._lock:
            self._counts["written"] += 1
        self._add(name, fingerprint, namespace, key, frozen_metadata(metadata), size)
        self._evict_over_budget()
        with self._lock:
            return name in self._entries

    def retain(self, fingerprint: str, namespace: str, keep: Iterable[Sequence[int]]) -> int:
        """Delete the files under ``fingerprint`` and ``namespace`` whose tokens are not in ``keep`` (a
        folder that mirrors one cache); how many."""
        wanted = {tuple(tokens) for tokens in keep}
        with self._lock:
            gone = [
                name
                for name, scope in self._scopes.items()
                if scope == (fingerprint, namespace) and self._entries[name].tokens not in wanted
            ]
        for name in gone:
            self._remove(name)
        return len(gone)

    def touch(self, entry: Entry, *, restored: bool = False) -> None:
        """Count a use of ``entry`` (a restore) for the retention order."""
        with self._lock:
            entry.last_used = next(self._clock)
            entry.hits += 1
            if restored:
                self._counts["restored"] += 1

    def discard(self, name: str) -> None:
        """Delete a file the engine refused for good (it will never load here)."""
        with self._lock:
            self._counts["discarded"] += 1
        self._remove(name)

    def count(self, what: str) -> None:
        """Count a writer or restore event: ``dropped``, ``failed`` or ``refused``."""
        with self._lock:
            self._counts[what] += 1

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(len(self._entries), sum(self._sizes.values()), self.max_bytes, **self._counts)

    # -- internals ---------------------------------------------------------------------------------
    def _add(
        self,
        name: str,
        fingerprint: str,
        namespace: str,
        tokens: tuple[int, ...],
        metadata: Mapping[str, str],
        size: int,
    ) -> None:
        with self._lock:
            tick = next(self._clock)
            entry = Entry((fingerprint, namespace), tokens, name, tick, tick, 0, metadata)
            replaced = self._index.insert((fingerprint, namespace), tokens, entry, tick)
            if replaced is not None and replaced.snapshot != name:
                self._forget(replaced.snapshot)
            self._entries[name], self._sizes[name] = entry, size
            self._scopes[name] = (fingerprint, namespace)

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if sum(self._sizes.values()) <= self.max_bytes or not self._entries:
                    return
                victim = min(self._entries.values(), key=self.policy.priority)
                self._counts["evicted"] += 1
            self._remove(victim.snapshot)

    def _remove(self, name: str) -> None:
        with self._lock:
            self._forget(name)
        self._unlink(name)

    def _forget(self, name: str) -> None:
        """Drop ``name`` from the index (lock held)."""
        entry = self._entries.pop(name, None)
        self._sizes.pop(name, None)
        scope = self._scopes.pop(name, None)
        if entry is not None and scope is not None and self._index.get(scope, entry.tokens) is entry:
            self._index.remove(scope, entry.tokens)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(OSError):
            (self.folder / name).unlink()
