"""An in-process prefix cache whose entries outlive the process: ``mlx_run_llm_batched --snapshot_dir``.

At start, :func:`restore_entries` loads the folder's snapshots taken under this engine's fingerprint
(most recent first, at most the cache's entry budget) and stores each in the prefix cache under the
tokens its engine record holds (the cache verifies them as it verifies any insert). After each round,
:func:`persist_entries` writes the entries not yet on disk (one file per prompt and engine
configuration, named by both, written atomically) and, at the end, :func:`prune` removes this
configuration's files whose entries the cache no longer holds, so the folder mirrors the cache.

Every file is checked before it enters the engine (format version, signature, checksum, content,
cache kind, geometry, fingerprint, shapes, room). With ``--snapshot_key`` files are written signed and
a file the key does not verify (``unsigned``, ``bad_signature``) is refused. A file that can never
load here (unreadable, unsigned or badly signed, a failed checksum or content check) is removed, and
its prompt is written again; one taken under another configuration is left for the engine it belongs
to. One folder serves one CLI run at a time (a second run pruning concurrently may remove the first
run's newest files; nothing worse: every load is checked).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from engine_service.api.content import content_digest
from engine_service.api.snapshot_files import LoadRefusal, list_snapshots, snapshot_name
from engine_service.persistence.snapshot_key import SnapshotKey
from engine_service.runtime.runner import Runner
from engine_service.sessions.session_files import load_session, save_session
from prefix_service.cache.prefix_cache import PrefixCache

# refusals of a file no engine will ever load: it is removed
_CORRUPT = (
    LoadRefusal.UNREADABLE,
    LoadRefusal.CHECKSUM,
    LoadRefusal.CONTENT,
    LoadRefusal.FORMAT_VERSION,
    LoadRefusal.UNSIGNED,
    LoadRefusal.BAD_SIGNATURE,
)


@dataclass
class Restored:
    """What :func:`restore_entries` did: entries stored, and why other files were not."""

    stored: int = 0
    refused: Counter = field(default_factory=Counter)  # reason -> files
    removed: int = 0
    positions: int = 0


def restore_entries(
    folder: str | os.PathLike,
    runner: Runner,
    cache: PrefixCache,
    namespace: str,
    *,
    key: SnapshotKey | None = None,
) -> Restored:
    """Load this engine configuration's snapshots from ``folder`` into ``cache`` under ``namespace``
    (at most ``cache.max_entries``, most recent first), verified with ``key`` when given."""
    done = Restored()
    prefix = runner.fingerprint[:16] + "-"
    for path in list_snapshots(folder):
        if done.stored >= cache.max_entries:
            break
        if not path.name.startswith(prefix):
            continue  # another engine configuration's file (its name says so): not read at all
        outcome = load_session(runner, path, key=key)
        if not outcome.loaded:
            done.refused[outcome.refusal.value] += 1
            if outcome.refusal in _CORRUPT:
                with contextlib.suppress(OSError):
                    path.unlink()
                    done.removed += 1
            continue
        if outcome.extra.get("namespace") != namespace:
            outcome.session.close()
            done.refused["namespace"] += 1
            continue
        if cache.insert(namespace, outcome.content, outcome.session, {"source": "disk"}).stored:
            done.stored += 1
            done.positions += outcome.positions
        else:
            done.refused["insert"] += 1
    return done


def entry_name(runner: Runner, tokens) -> str:
    return snapshot_name(runner.fingerprint, content_digest(tokens))


def persist_entries(
    folder: str | os.PathLike,
    runner: Runner,
    cache: PrefixCache,
    namespace: str,
    *,
    key: SnapshotKey | None = None,
) -> tuple[int, int]:
    """Write ``cache``'s entries under ``namespace`` that have no file yet (signed with ``key`` when
    given); returns (files, bytes)."""
    written = size = 0
    for entry in cache.entries(namespace):
        name = entry_name(runner, entry.tokens)
        if (Path(folder) / name).exists():
            continue  # the same content under the same configuration: the file already holds it
        outcome = save_session(entry.snapshot, folder, name=name, extra={"namespace": namespace}, key=key)
        if outcome.saved:
            written += 1
            size += outcome.file_bytes
    return written, size


def prune(folder: str | os.PathLike, runner: Runner, cache: PrefixCache, namespace: str) -> int:
    """Remove this configuration's files whose entries ``cache`` no longer holds; returns how many."""
    keep = {entry_name(runner, entry.tokens) for entry in cache.entries(namespace)}
    prefix = runner.fingerprint[:16] + "-"
    removed = 0
    for path in list_snapshots(folder):
        if path.name.startswith(prefix) and path.name not in keep:
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


class PersistentEntries:
    """The CLI's use of the functions above: one folder, one runner, one cache, one namespace. A disk
    problem (OSError) is a warning on ``err``: generations never fail for it. ``key`` signs and
    verifies the files (``--snapshot_key``)."""

    def __init__(
        self,
        folder: str,
        runner: Runner,
        cache: PrefixCache,
        namespace: str,
        err: TextIO | None = None,
        *,
        key: SnapshotKey | None = None,
    ) -> None:
        self.folder, self._runner, self._cache, self._namespace = folder, runner, cache, namespace
        self._err = err if err is not None else sys.stderr
        self._key = key

    def restore(self, out: TextIO) -> Restored | None:
        """Load what a previous run left (the folder is created when missing); one line on ``out``."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            done = restore_entries(self.folder, self._runner, self._cache, self._namespace, key=self._key)
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
        """Write the entries that have no file yet (after a round)."""
        try:
            persist_entries(self.folder, self._runner, self._cache, self._namespace, key=self._key)
        except OSError as exc:
            self._warn(exc)

    def finish(self, out: TextIO) -> None:
        """Remove evicted entries' files; one line on ``out`` with what the folder holds for this engine."""
        try:
            prune(self.folder, self._runner, self._cache, self._namespace)
            prefix = self._runner.fingerprint[:16] + "-"
            files = [p for p in list_snapshots(self.folder) if p.name.startswith(prefix)]
            size = sum(p.stat().st_size for p in files)
        except OSError as exc:
            self._warn(exc)
            return
        print(f"snapshots: {len(files)} in {self.folder} ({size / 1e6:.1f} MB)", file=out, flush=True)

    def _warn(self, exc: OSError) -> None:
        print(f"warning: --snapshot_dir: {exc}", file=self._err, flush=True)
