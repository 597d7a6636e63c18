"""An in-process prefix cache whose entries outlive the process (``mlx_run_llm_batched --snapshot_dir``):
the prefix service's persistent tier over the CLI's ``RunnerBackend``; the folder mirrors the cache.
Spec: docs/SNAPSHOTS.md (The CLI's folder)."""

from __future__ import annotations

import sys
from typing import TextIO

from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.tier.persistent_tier import PersistentTier, Restored

NO_BUDGET = 1 << 62  # the folder mirrors the cache: no byte budget of its own


class PersistentEntries:
    """The CLI's snapshot folder: one folder, one cache (over a ``RunnerBackend``), one namespace. A
    disk problem (OSError) is a warning on ``err``: generations never fail for it."""

    def __init__(self, folder: str, cache: PrefixCache, namespace: str, err: TextIO | None = None) -> None:
        self.folder, self._cache, self._namespace = folder, cache, namespace
        self._err = err if err is not None else sys.stderr
        self._tier: PersistentTier | None = None

    def restore(self, out: TextIO) -> Restored | None:
        """Load what a previous run left (the folder is created when missing); one line on ``out``."""
        entries = self._cache.max_entries
        try:
            self._tier = PersistentTier.open(self.folder, NO_BUDGET, queue_size=entries + 1, preload=entries)
            done = self._tier.preload(self._cache)
        except OSError as exc:
            return self._warn(exc)
        refused = ", ".join(f"{n} {reason}" for reason, n in sorted(done.refused.items()))
        print(
            f"snapshots: loaded {done.stored} from {self.folder} ({done.positions} positions)"
            + (f"; refused {refused}" if refused else "")
            + (f"; removed {done.removed} corrupt" if done.removed else ""),
            file=out,
            flush=True,
        )
        return done

    def persist(self) -> None:
        """Write the entries that have no file yet (after a round); returns once they are written."""
        if self._tier is None:
            return
        for entry in self._cache.entries(self._namespace):
            self._tier.persist(self._cache, self._namespace, entry.tokens, entry.snapshot, entry.metadata)
        self._tier.writer.flush()

    def finish(self, out: TextIO) -> None:
        """Remove evicted entries' files; one line on ``out`` with what the folder holds for this engine."""
        tier = self._tier
        if tier is None:
            return
        fingerprint = self._cache.backend.fingerprint
        try:
            tier.writer.flush()
            keep = [entry.tokens for entry in self._cache.entries(self._namespace)]
            tier.store.retain(fingerprint, self._namespace, keep)
            files, size = tier.store.usage(fingerprint)
        except OSError as exc:
            self._warn(exc)
            return
        finally:
            tier.stop()
        print(f"snapshots: {files} in {self.folder} ({size / 1e6:.1f} MB)", file=out, flush=True)

    def _warn(self, exc: OSError) -> None:
        print(f"warning: --snapshot_dir: {exc}", file=self._err, flush=True)
