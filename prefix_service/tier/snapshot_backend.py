"""What the persistent tier needs from an engine: export and import snapshot files."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, runtime_checkable

from engine_service.api.answers import ImportedSnapshot


@runtime_checkable
class SnapshotBackend(Protocol):
    """An engine that exports and imports snapshot files (``snapshot_store.py`` keeps them)."""

    # the file of a handle this backend owns (positions [0, upto); None: all) as chunks, ``extra``
    # stored in it; None when the engine refused (a prepared input, past the length, below a floor)
    def export_session(
        self, handle: str, extra: Mapping[str, str], upto: int | None = None
    ) -> Iterator[bytes] | None: ...

    def import_session(self, chunks: Iterable[bytes]) -> ImportedSnapshot: ...  # into a new session it owns
