"""What the engine's cache kinds mean to a prefix cache above it, by name (``EngineInfo.cache_kind``):
which kinds' clones share their source's storage (a cloned prefix held once)."""

from __future__ import annotations

PREFIX_SHARING_KINDS = frozenset({"batched-cell"})  # a clone shares the source's cells at any position


def kind_shares_prefixes(cache_kind: str) -> bool:
    """Whether clones on an engine of ``cache_kind`` share their prefix's storage with the source."""
    return cache_kind in PREFIX_SHARING_KINDS
