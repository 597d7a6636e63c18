"""PersistentTier: the snapshot directory (``snapshot_store.py``) as the gateways use it (and the CLI's
``clients/snapshot_dir.py``, over an in-process engine).

- :meth:`PersistentTier.persist`: an entry just stored in an engine's memory cache is queued for the
  writer (``snapshot_writer.py``), off the request path.
- :meth:`PersistentTier.restore`: before a lookup, when the folder holds a longer prefix of the prompt
  than the engine's memory cache, the file is loaded into that engine (``ImportSession``: the engine
  checks format, checksum, content, fingerprint and geometry before anything enters its cache) and
  stored as a memory entry (the cache verifies its content digest against the key, as for any
  insert); the lookup then finds it. So after an engine restart or a prefix-service restart the
  first lookup of a prompt is served from disk. A file the engine refuses is deleted unless the refusal
  is another configuration's or the engine's state now (:data:`KEPT`), so its prompt is persisted
  again at its next store (the writer skips the keys the folder holds).
- :meth:`PersistentTier.preload`: eagerly restore the most recently used files into an engine that
  just (re)joined, up to ``preload`` entries (``--snapshot_preload``; 0: lazily only); it says what
  came of each (:class:`Restored`).

Only engines that can export and import (``snapshot_backend.SnapshotBackend``) take part.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine_service.api.errors import ForklineError
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import Entry
from prefix_service.cache.session_backend import SessionBackend, max_rewind
from prefix_service.tier.snapshot_backend import SnapshotBackend
from prefix_service.tier.snapshot_store import SnapshotStore
from prefix_service.tier.snapshot_writer import SnapshotWriter, WriteJob

log = logging.getLogger(__name__)

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
    """See the module docstring. :meth:`open` builds one over a folder. ``kept``: the engine's
    refusals that leave a file in place (any other deletes it)."""

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
        """The tier over ``folder`` (created if missing; its files indexed, stale temporaries
        deleted) with a byte budget, the retention ``policy``, the writer's queue bound."""
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
    ) -> None:
        backend = cache.backend
        if isinstance(backend, SnapshotBackend):
            self.writer.submit(
                WriteJob(
                    backend.fingerprint,
                    namespace,
                    tuple(tokens),
                    dict(metadata),
                    handle,
                    backend.export_session,
                )
            )

    def reusable(self, backend: SessionBackend, namespace: str, key: tuple[int, ...]) -> int:
        """The positions of ``key`` the folder's longest stored prefix gives ``backend``'s engines (0:
        none; with the same ring rule as :meth:`restore`): what a route may count on an engine that
        restores it first (``fleet/cost_model.py``'s snapshot directory source)."""
        if not isinstance(backend, SnapshotBackend):
            return 0
        found = self.store.match(backend.fingerprint, namespace, key, max_rewind(backend))
        return 0 if found is None else found.reusable

    def restore(
        self, cache: PrefixCache, namespace: str, key: tuple[int, ...], done: Restored | None = None
    ) -> bool:
        """Load the folder's longest stored prefix of ``key`` into ``cache``'s engine when it reuses
        more than the memory cache can; True when an entry was added (``done``, when given, counts
        it and its positions). On an engine whose ring evicts
        window rows only a file that can be cloned at the divergence counts (as in the memory cache),
        so a divergence below every floor does not import a file the clone would refuse."""
        backend = cache.backend
        if not isinstance(backend, SnapshotBackend) or cache.max_entries == 0:
            return False
        found = self.store.match(backend.fingerprint, namespace, key, max_rewind(backend))
        if found is None or found.reusable <= cache.reusable(namespace, key):
            return False
        return self._load(cache, backend, found.entry, Restored() if done is None else done)

    def preload(self, cache: PrefixCache) -> Restored:
        """Restore up to ``preload`` of the most recently used files into ``cache``'s engine."""
        backend, done = cache.backend, Restored()
        if not isinstance(backend, SnapshotBackend) or self.preload_entries <= 0:
            return done
        for entry in self.store.recent(backend.fingerprint, min(self.preload_entries, cache.max_entries)):
            namespace = entry.namespace[1]
            if cache.reusable(namespace, entry.tokens) >= len(entry.tokens) - 1:
                continue  # already in memory
            self._load(cache, backend, entry, done)
        return done

    def preload_in_background(self, cache: PrefixCache, on_loaded: Callable[[], None] = lambda: None) -> None:
        """:meth:`preload` on a thread of its own (an optimisation: lookups restore lazily anyway);
        ``on_loaded()`` runs when it restored something."""
        if self.preload_entries <= 0:
            return

        def run() -> None:
            try:
                loaded = self.preload(cache).stored
            except Exception:  # noqa: BLE001 - a failed preload leaves the lazy restore
                log.warning("snapshot preload failed", exc_info=True)
                return
            if loaded:
                log.info("restored %d snapshots from the snapshot directory", loaded)
                on_loaded()

        threading.Thread(target=run, name="forkline-snapshot-preload", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self.writer.stop(timeout)

    def _load(self, cache: PrefixCache, backend: SnapshotBackend, entry: Entry, done: Restored) -> bool:
        """Import ``entry``'s file into the engine and store it in ``cache``; ``done`` counts what came of it."""
        try:
            imported = backend.import_session(self.store.read(entry.snapshot))
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
        outcome = cache.insert(entry.namespace[1], entry.tokens, imported.handle, entry.metadata)
        self.store.touch(entry, restored=True)
        if not outcome.stored:
            done.refused["insert"] += 1
            return False
        done.stored += 1
        done.positions += len(entry.tokens)
        return True
