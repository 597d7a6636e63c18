"""Cache events: what the prefix caches store and drop, published to subscribers (an external router, a
dashboard) through an :class:`EventHub`; bounded queues that drop (and say so with a ``GAP``) rather
than block the cache. Spec: docs/ROUTING.md#cache-events."""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from engine_service.api.content import content_digest
from engine_service.api.errors import InvalidArgument, ResourceExhausted
from prefix_service.cache.retention import Entry

DEFAULT_CAPACITY = 1024
MAX_SUBSCRIBERS = 16  # each stream holds one of the server's worker threads


class EventKind(StrEnum):
    STORED = "stored"  # an entry was stored (or replayed)
    MOVED = "moved"  # stored as a copy of another engine's snapshot (``source`` names it)
    EVICTED = "evicted"  # the retention policy dropped it (bounds, pressure)
    CLEARED = "cleared"  # a Clear, an engine restart or shutdown dropped it
    DROPPED = "dropped"  # its handle was found dead, or a longer entry covers it (sharing.py)
    GAP = "gap"  # ``missed`` events were dropped for this subscriber
    SYNCED = "synced"  # the replay is complete


@dataclass(frozen=True)
class EntryChange:
    """What a cache tells its listener: ``kind`` happened to ``entry`` (MOVED: from engine ``source``)."""

    kind: EventKind
    entry: Entry
    source: str = ""


@dataclass(frozen=True)
class CacheEvent:
    """One event as a subscriber reads it (the entry's fields empty / 0 on GAP and SYNCED)."""

    kind: EventKind
    sequence: int  # of the events this subscription may see, dropped ones included, from 1
    engine: str
    instance_id: str
    time: float  # Unix seconds when it was published
    scope: str = ""  # the entry's tenancy scope
    positions: int = 0
    digest: bytes = b""  # the content digest of its tokens (never the tokens)
    replayed: bool = False
    missed: int = 0
    replica: str = ""  # the hub's id (one per service process)
    source: str = ""  # MOVED: the engine the snapshot was copied from


class Listenable(Protocol):
    """A cache the hub can follow (``PrefixCache``)."""

    def listen(self, listener: Callable[[EntryChange], None] | None) -> None: ...

    def entries(self, namespace: str | None = None) -> list[Entry]: ...


@dataclass(frozen=True)
class _Source:
    engine: str
    instance_id: Callable[[], str]


@dataclass(frozen=True)
class _Record:
    """An event before a subscription numbers it (numbers follow the delivery order)."""

    kind: EventKind
    engine: str
    instance_id: str
    time: float
    scope: str
    positions: int
    digest: bytes
    replayed: bool = False
    source: str = ""


class _Gap:
    """Events dropped at this point of a full queue."""

    def __init__(self) -> None:
        self.missed = 1


def scope_of(entry: Entry) -> str:
    """The tenancy scope of a cache entry (the cache keys it by (fingerprint, scope))."""
    namespace = entry.namespace
    return str(namespace[1]) if isinstance(namespace, tuple) and len(namespace) == 2 else str(namespace)


def _record(
    kind: EventKind,
    source: _Source,
    instance_id: str,
    entry: Entry,
    *,
    replayed: bool = False,
    moved_from: str = "",
) -> _Record:
    """What ``entry``'s change becomes, stamped now (its digest computed here: only for a taker)."""
    return _Record(
        kind,
        source.engine,
        instance_id,
        time.time(),
        scope_of(entry),
        entry.key_length,
        _digest(entry.tokens),
        replayed,
        moved_from,
    )


def _digest(tokens: Iterable[int]) -> bytes:
    try:
        return content_digest(list(tokens))
    except InvalidArgument:  # not a session's content: no entry holds such ids
        return b""


class Subscription:
    """One subscriber's bounded queue: at most ``capacity`` events, plus one GAP marker while events
    are dropped (``dropped``: all it missed). The hub puts, never blocking; one reader gets."""

    def __init__(self, hub: EventHub, where: Callable[[str], bool] | None, capacity: int) -> None:
        self._hub, self.where, self.capacity = hub, where, capacity
        self._cond = threading.Condition()
        self._queue: deque[_Record | _Gap] = deque()
        self._replay: deque[_Record] = deque()
        self._synced = True
        self._sequence = 0
        self.dropped = 0
        self.closed = False

    def accepts(self, scope: str) -> bool:
        return self.where is None or self.where(scope)

    def put(self, record: _Record) -> None:
        """Queue ``record`` (the hub checked :meth:`accepts`), or count it dropped when full."""
        with self._cond:
            if self.closed:
                return
            if len(self._queue) < self.capacity:
                self._queue.append(record)
            else:
                self.dropped += 1
                tail = self._queue[-1] if self._queue else None
                if isinstance(tail, _Gap):
                    tail.missed += 1
                else:
                    self._queue.append(_Gap())
            self._cond.notify()

    def start_replay(self, records: list[_Record]) -> None:
        """Deliver ``records`` then SYNCED before the queued events."""
        with self._cond:
            self._replay.extend(records)
            self._synced = False
            self._cond.notify()

    def get(self, timeout: float | None = None) -> CacheEvent | None:
        """The next event; None when closed, or when ``timeout`` seconds passed without one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self.closed:
                event = self._next()
                if event is not None:
                    return event
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            return None

    def __iter__(self) -> Iterator[CacheEvent]:
        """The events until the subscription closes."""
        while (event := self.get()) is not None:
            yield event

    def close(self) -> None:
        """Unsubscribe and wake the reader (idempotent)."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        self._hub.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _next(self) -> CacheEvent | None:
        """The next event in delivery order (lock held): replay, SYNCED, the queue."""
        if self._replay:
            return self._numbered(self._replay.popleft())
        if not self._synced:
            self._synced = True
            return self._marker(EventKind.SYNCED, 1)
        if not self._queue:
            return None
        item = self._queue.popleft()
        if isinstance(item, _Gap):
            return self._marker(EventKind.GAP, item.missed)
        return self._numbered(item)

    def _numbered(self, record: _Record) -> CacheEvent:
        self._sequence += 1
        return CacheEvent(
            record.kind,
            self._sequence,
            record.engine,
            record.instance_id,
            record.time,
            record.scope,
            record.positions,
            record.digest,
            record.replayed,
            replica=self._hub.replica,
            source=record.source,
        )

    def _marker(self, kind: EventKind, numbers: int) -> CacheEvent:
        """SYNCED (one number) or GAP (the numbers of the events it stands for: its sequence is the last)."""
        self._sequence += numbers
        missed = numbers if kind is EventKind.GAP else 0
        return CacheEvent(kind, self._sequence, "", "", time.time(), missed=missed, replica=self._hub.replica)


class EventHub:
    """The caches' events of one service process (``replica``) and their subscribers."""

    def __init__(self, *, max_subscribers: int = MAX_SUBSCRIBERS) -> None:
        self.replica = uuid.uuid4().hex[:16]
        self.max_subscribers = max_subscribers
        self._lock = threading.Lock()
        self._subscribers: list[Subscription] = []
        self._sources: dict[int, tuple[_Source, Listenable]] = {}
        self._closed = False

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def attach(self, cache: Listenable, engine: str, instance_id: Callable[[], str]) -> None:
        """Follow ``cache`` as engine ``engine``'s (``instance_id()`` read per event); again: rebinds."""
        source = _Source(engine, instance_id)
        with self._lock:
            self._sources[id(cache)] = (source, cache)
        cache.listen(lambda change: self._publish(source, change))

    def detach(self, cache: Listenable) -> None:
        with self._lock:
            self._sources.pop(id(cache), None)
        cache.listen(None)

    def retain(self, caches: Iterable[Listenable]) -> None:
        """Detach every cache but ``caches`` (e.g. those of engines that left: nothing of theirs replayed)."""
        keep = {id(cache) for cache in caches}
        with self._lock:
            gone = [cache for key, (_, cache) in self._sources.items() if key not in keep]
        for cache in gone:
            self.detach(cache)

    def subscribe(
        self,
        where: Callable[[str], bool] | None = None,
        *,
        replay: bool = False,
        capacity: int = DEFAULT_CAPACITY,
    ) -> Subscription:
        """The events of the scopes ``where`` accepts (None: all), after a replay of the entries when
        ``replay``; ResourceExhausted past ``max_subscribers``; a closed hub gives a closed subscription."""
        if not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgument(f"capacity must be an int >= 1, got {capacity!r}")
        subscription = Subscription(self, where, capacity)
        with self._lock:
            if self._closed:
                subscription.closed = True
                return subscription
            if len(self._subscribers) >= self.max_subscribers:
                raise ResourceExhausted(f"at most {self.max_subscribers} cache event streams at once")
            self._subscribers.append(subscription)
            sources = list(self._sources.values())
        if (
            replay
        ):  # read after subscribing (an event may repeat the replay: both idempotent), outside the hub's lock
            subscription.start_replay([r for s, c in sources for r in self._replayed(s, c, subscription)])
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    def close(self) -> None:
        """End every subscription (server shutdown); later subscriptions are closed at once."""
        with self._lock:
            self._closed = True
            subscribers = list(self._subscribers)
        for subscription in subscribers:
            subscription.close()

    def _publish(self, source: _Source, change: EntryChange) -> None:
        """The caches' listener (their lock held): no work while no subscriber takes the scope."""
        scope = scope_of(change.entry)
        with self._lock:
            takers = [s for s in self._subscribers if s.accepts(scope)]
        if not takers:
            return
        record = _record(change.kind, source, source.instance_id(), change.entry, moved_from=change.source)
        for subscription in takers:
            subscription.put(record)

    @staticmethod
    def _replayed(source: _Source, cache: Listenable, subscription: Subscription) -> list[_Record]:
        instance_id = source.instance_id()
        return [
            _record(EventKind.STORED, source, instance_id, entry, replayed=True)
            for entry in cache.entries()
            if subscription.accepts(scope_of(entry))
        ]
