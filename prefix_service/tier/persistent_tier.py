"""PersistentTier: the snapshot directory (``snapshot_store.py``) as the gateways use it (and the CLI's
``clients/snapshot_dir.py``): entries persisted off the request path, restored into an engine when the
folder holds a longer prefix than its memory cache. Spec: docs/SNAPSHOTS.md#the-prefix-services-folder---snapshot_dir."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_service.api.errors import ForklineError
from prefix_service.cache.outcomes import InsertOutcome
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import Entry
from prefix_service.cache.session_backend import SessionBackend, max_rewind
from prefix_service.tier.snapshot_backend import SnapshotBackend
from prefix_service.tier.snapshot_store import SnapshotStore
from prefix_service.tier.snapshot_writer import SnapshotWriter, WriteJob

log = logging.getLogger(__name__)

# How a restored entry is stored: (namespace, tokens, handle, metadata) -> the insert's outcome.
Store = Callable[[str, Sequence[int], Any, Mapping[str, str]], InsertOutcome]

# ImportSession refusals (``LoadRefusal`` names) that leave a file in place: another configuration's
# (an engine of another model, tokenizer, weights dtype, cache kind or window geometry, or of longer
# sessions, or one that imports nothing, may load it) or the engine's state now (full, stopping). Any
# other refusal -- unreadable, format_version, checksum, unsigned, bad_signature, content, shape, or a
# reason this code does not know -- means no engine of this configuration will ever load the file: it
# is deleted, and the prompt is written again the next time it is stored.
ANOTHER_CONFIGURATION = frozenset({"fingerprint", "cache_kind", "geometry", "too_long", "unsupported"})
TRANSIENT = frozenset({"no_room", "stopping"})
KEPT = ANOTHER_CONFIGURATION | TRANSIENT


@dataclass
class Restored:
    """What a preload did: entries ``stored`` (holding ``positions``), files ``refused`` by the engine's
    reason (or ``insert``: the cache did not store it), refused files ``removed``."""

    stored: int = 0
    positions: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    removed: int = 0


class PersistentTier:
    """``kept``: the engine's refusals that leave a file in place (any other deletes it)."""

    @classmethod
    def open(
        cls,
        folder: str,
        max_bytes: int,
        policy: str = "lru",
        *,
        queue_size: int = 32,
        preload: int = 0,
        kept: frozenset[str] = KEPT,
    ) -> PersistentTier:
        """The tier over ``folder`` (created if missing, its files indexed) with a byte budget."""
        store = SnapshotStore(folder, max_bytes, policy)
        return cls(store, SnapshotWriter(store, queue_size), preload, kept)

    def __init__(
        self,
        store: SnapshotStore,
        writer: SnapshotWriter,
        preload: int = 0,
        kept: frozenset[str] = KEPT,
    ) -> None:
        self.store, self.writer, self.preload_entries, self.kept = store, writer, preload, kept

    def persist(
        self,
        cache: PrefixCache,
        namespace: str,
        tokens: Sequence[int],
        handle: object,
        metadata: Mapping[str, str],
        files: SnapshotBackend | None = None,
    ) -> None:
        """Queue the entry just stored in ``cache`` for the writer. ``files``: its engine's snapshot
        files (default: the cache's backend, when it exports)."""
        files = _files(cache, files)
        if files is not None:
            fingerprint = cache.backend.fingerprint
            self.writer.submit(
                WriteJob(fingerprint, namespace, tuple(tokens), dict(metadata), handle, files.export_session)
            )

    def reusable(self, backend: SessionBackend, namespace: str, key: tuple[int, ...]) -> int:
        """The positions of ``key`` the folder's longest stored prefix gives ``backend``'s engines (0:
        none; the ring rule of :meth:`restore`): what a route may count on an engine that restores it."""
        found = self.store.match(backend.fingerprint, namespace, key, max_rewind(backend))
        return 0 if found is None else found.reusable

    def restore(
        self,
        cache: PrefixCache,
        namespace: str,
        key: tuple[int, ...],
        done: Restored | None = None,
        *,
        files: SnapshotBackend | None = None,
        store: Store | None = None,
    ) -> bool:
        """Load the folder's longest stored prefix of ``key`` into ``cache``'s engine when it reuses
        more than the memory cache can (on a ring, only a file a clone can reach at the divergence);
        True when ``store`` (default: ``cache.insert``) stored it; ``done`` counts it."""
        files = _files(cache, files)
        if files is None or cache.max_entries == 0:
            return False
        backend = cache.backend
        found = self.store.match(backend.fingerprint, namespace, key, max_rewind(backend))
        if found is None or found.reusable <= cache.reusable(namespace, key):
            return False
        return self._load(files, store or cache.insert, found.entry, Restored() if done is None else done)

    def preload(
        self, cache: PrefixCache, *, files: SnapshotBackend | None = None, store: Store | None = None
    ) -> Restored:
        """Restore up to ``preload`` of the most recently used files into ``cache``'s engine."""
        files, done = _files(cache, files), Restored()
        if files is None or self.preload_entries <= 0:
            return done
        fingerprint = cache.backend.fingerprint
        for entry in self.store.recent(fingerprint, min(self.preload_entries, cache.max_entries)):
            namespace = entry.namespace[1]
            if cache.reusable(namespace, entry.tokens) >= len(entry.tokens) - 1:
                continue  # already in memory
            self._load(files, store or cache.insert, entry, done)
        return done

    def preload_in_background(
        self,
        cache: PrefixCache,
        on_loaded: Callable[[], None] = lambda: None,
        *,
        files: SnapshotBackend | None = None,
        store: Store | None = None,
    ) -> None:
        """:meth:`preload` on a thread; ``on_loaded()`` runs when it restored something."""
        if self.preload_entries <= 0:
            return

        def run() -> None:
            try:
                loaded = self.preload(cache, files=files, store=store).stored
            except Exception:  # noqa: BLE001 - a failed preload leaves the lazy restore
                log.warning("snapshot preload failed", exc_info=True)
                return
            if loaded:
                log.info("restored %d snapshots from the snapshot directory", loaded)
                on_loaded()

        threading.Thread(target=run, name="forkline-snapshot-preload", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self.writer.stop(timeout)

    def _load(self, files: SnapshotBackend, store: Store, entry: Entry, done: Restored) -> bool:
        """Import ``entry``'s file into the engine and ``store`` it; ``done`` counts what came of it."""
        try:
            imported = files.import_session(self.store.read(entry.snapshot))
        except OSError:  # deleted meanwhile (evicted)
            return False
        except ForklineError as exc:  # e.g. the engine is down or full: a miss, the file stays
            log.info("snapshot dir: %s not restored: %s", entry.snapshot, exc)
            self.store.count("refused")
            done.refused[type(exc).__name__] += 1
            return False
        if imported.handle is None:
            self.store.count("refused")
            done.refused[imported.refusal] += 1
            log.info(
                "snapshot dir: the engine refused %s: %s %s",
                entry.snapshot,
                imported.refusal,
                imported.detail,
            )
            if imported.refusal not in self.kept:  # never loadable here: written again when stored
                self.store.discard(entry.snapshot)
                done.removed += 1
            return False
        outcome = store(entry.namespace[1], entry.tokens, imported.handle, entry.metadata)
        self.store.touch(entry, restored=True)
        if not outcome.stored:
            done.refused["insert"] += 1
            return False
        done.stored += 1
        done.positions += len(entry.tokens)
        return True


def _files(cache: PrefixCache, files: SnapshotBackend | None) -> SnapshotBackend | None:
    """``files``, or the cache's backend when it exports and imports (an in-process engine)."""
    if files is not None:
        return files
    return cache.backend if isinstance(cache.backend, SnapshotBackend) else None
