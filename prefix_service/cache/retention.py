"""Retention: which stored snapshot the prefix cache evicts first -- a :class:`RetentionPolicy` returns a
sort key per entry (lowest goes first), chosen by name: ``lru`` (default: unreused checkpoints first,
never a prompt reused more than a checkpoint for it), ``priority`` (metadata priority, then
checkpoints and branch points outlive prompts, then LRU), ``lfu``. A branch point's bookkeeping
counts its subtree's hits (``PrefixCache`` refreshes it with them): it outlives its leaves."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engine_service.api.errors import InvalidArgument
from engine_service.api.stream_events import SnapshotKind

BOUNDARY_KEY = (
    "boundary"  # metadata naming the snapshot kind (engine_service/api/stream_events.py SnapshotKind)
)
PRIORITY_KEY = "priority"
BRANCH = "branch"  # the boundary of a branch point: a snapshot where stored prompts diverge
NO_METADATA: Mapping[str, str] = MappingProxyType({})


@dataclass(eq=False, slots=True)  # slots: 10k+ entries stay cheap for the cyclic GC
class Entry:
    """One stored snapshot and its bookkeeping (mutable: the cache refreshes it on hits). Policies read
    the bookkeeping, never the snapshot."""

    namespace: Hashable  # (fingerprint, namespace): with ``tokens``, the key
    tokens: tuple[int, ...]  # the snapshot holds exactly these positions
    snapshot: Any  # the opaque backend handle the cache owns
    created: int  # the cache's logical clock (strictly increasing over inserts, hits, refreshes)
    last_used: int
    hits: int = 0  # lookups served
    metadata: Mapping[str, str] = field(default_factory=lambda: NO_METADATA)  # priority, boundary, ...
    reused: int = 0  # positions those lookups reused
    subtree_hits: int = 0  # a branch point: the hits of the entries below it
    shadowed: int = 0  # its leading positions a branch point above it serves too

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("Entry.tokens must not be empty")

    @property
    def key_length(self) -> int:
        return len(self.tokens)

    @property
    def boundary(self) -> str:
        return self.metadata.get(BOUNDARY_KEY, "")

    @property
    def is_checkpoint(self) -> bool:
        return self.boundary == SnapshotKind.BREAKPOINT

    @property
    def is_branch(self) -> bool:
        return self.boundary == BRANCH

    @property
    def is_inner(self) -> bool:
        """A checkpoint or branch point: kept under the longer entries that pass through it."""
        return inner_node(self.metadata)

    @property
    def mostly_shadowed(self) -> bool:
        """A branch point above serves at least half of it: evicting it frees an entry (and a whole
        copy where clones copy) and loses only its tail."""
        return self.shadowed > 0 and 2 * self.shadowed >= self.key_length


def inner_node(metadata: Mapping[str, str]) -> bool:
    """Whether an entry of ``metadata`` is a checkpoint or a branch point."""
    return metadata.get(BOUNDARY_KEY) in (SnapshotKind.BREAKPOINT, BRANCH)


def frozen_metadata(metadata: Mapping[str, Any] | None) -> Mapping[str, str]:
    """Application metadata as an entry keeps it: read-only, string values (InvalidArgument for
    anything but a mapping with string keys)."""
    if metadata is None:
        return NO_METADATA
    if not isinstance(metadata, Mapping):
        raise InvalidArgument(f"metadata must be a mapping of strings, got {type(metadata).__name__}")
    for name in metadata:
        if not isinstance(name, str):
            raise InvalidArgument(f"metadata keys must be strings, got {name!r}")
    return (
        MappingProxyType({name: str(value) for name, value in metadata.items()}) if metadata else NO_METADATA
    )


class RetentionPolicy(ABC):
    """Decides eviction order: the entry with the lowest :meth:`priority` goes first."""

    name: str = "custom"

    @abstractmethod
    def priority(self, entry: Entry) -> tuple[Any, ...]:
        """Sort key of ``entry``; lowest is evicted first. Must not raise for any metadata."""

    def victim(self, entries: Iterable[Entry]) -> Entry:
        """The entry evicted next (default: the lowest :meth:`priority`)."""
        return min(entries, key=self.priority)


class LRUPolicy(RetentionPolicy):
    """Least recently used, except: a checkpoint no lookup used goes first, then entries a branch point
    above mostly serves too; a prompt is never evicted while a checkpoint reused less than it is stored
    (that checkpoint goes instead)."""

    name = "lru"

    def priority(self, entry: Entry) -> tuple[Any, ...]:
        unused_checkpoint = entry.is_checkpoint and entry.hits == 0
        tier = 0 if unused_checkpoint else (1 if entry.mostly_shadowed else 2)
        return (tier, entry.last_used, 1 if entry.is_branch else 0)

    def victim(self, entries: Iterable[Entry]) -> Entry:
        entries = list(entries)
        chosen = min(entries, key=self.priority)
        if chosen.is_checkpoint:
            return chosen
        cheaper = [e for e in entries if e.is_checkpoint and e.hits < chosen.hits]
        return min(cheaper, key=self.priority) if cheaper else chosen


class LFUPolicy(RetentionPolicy):
    name = "lfu"

    def priority(self, entry: Entry) -> tuple[Any, ...]:
        return (entry.hits + entry.subtree_hits, entry.last_used, 1 if entry.is_branch else 0)


def _metadata_priority(metadata: Mapping[str, str]) -> float:
    """The numeric ``priority`` metadata; a missing or unparsable value counts as 0."""
    try:
        value = float(metadata.get(PRIORITY_KEY, 0))
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) else 0.0


class PriorityPolicy(RetentionPolicy):
    name = "priority"

    def priority(self, entry: Entry) -> tuple[Any, ...]:
        kept = 1 if entry.is_checkpoint or entry.is_branch else 0
        return (_metadata_priority(entry.metadata), kept, entry.last_used)


_REGISTRY: dict[str, Callable[[], RetentionPolicy]] = {
    "lru": LRUPolicy,
    "priority": PriorityPolicy,
    "lfu": LFUPolicy,
}


def register_policy(name: str, factory: Callable[[], RetentionPolicy]) -> None:
    """Make ``factory`` selectable as ``name`` (e.g. a TTL or pinning policy)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"policy name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = factory


def policy_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def make_policy(policy: str | RetentionPolicy) -> RetentionPolicy:
    """A policy instance from a registered name, or ``policy`` itself when it already is one."""
    if isinstance(policy, RetentionPolicy):
        return policy
    factory = _REGISTRY.get(policy) if isinstance(policy, str) else None
    if factory is None:
        raise InvalidArgument(
            f"unknown retention policy {policy!r}; valid policies: {', '.join(policy_names())}"
        )
    return factory()
