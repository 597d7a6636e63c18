"""What the engine's cache kinds mean to a prefix cache above it: how much of a clone shares its
source's storage (a cloned prefix held once), from the bytes the engine reports or else its kind's name
(``EngineInfo.cache_kind``)."""

from __future__ import annotations

PREFIX_SHARING_KINDS = frozenset({"batched-cell"})  # a clone shares the source's cells at any position


def clone_shared_share(
    cache_kind: str, bytes_per_position: int = 0, shared_bytes_per_position: int = 0
) -> float:
    """The share in [0, 1] of one position's K/V bytes a clone on an engine shares with its source: the
    engine's ``clone_shared_bytes_per_position / kv_bytes_per_position`` where it reports them, else 1
    for a kind in :data:`PREFIX_SHARING_KINDS` and 0 (a whole copy) for any other."""
    if bytes_per_position > 0 and shared_bytes_per_position > 0:
        return min(1.0, shared_bytes_per_position / bytes_per_position)
    return 1.0 if cache_kind in PREFIX_SHARING_KINDS else 0.0
