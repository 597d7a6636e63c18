"""A prefix namespace kept on one prefix-service replica: a consistent-hash ring over the replicas'
addresses (:class:`HashRing`) and a client that routes by it and re-homes a namespace while its replica
is down (:class:`ReplicatedPrefixClient`). Spec: docs/ROUTING.md ("Keeping a namespace on one replica")."""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from clients.prefix_client import PrefixClient
from engine_service.api.errors import Unavailable
from engine_service.serving.auth import ClientSecurity

log = logging.getLogger(__name__)

DEFAULT_VNODES = 128  # points per replica: with 128, each replica's share of keys is within ~10% of 1/N
DEFAULT_RETRY_AFTER_S = 2.0  # how long a replica that answered UNAVAILABLE is passed over
RECONNECT_OPTIONS = (  # a replica's channel retries its connection at most every second (gRPC: 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
_HASH_PERSON = b"forkline-ring-v1"  # BLAKE2b personalisation: the ring's hash is its own


def ring_hash(text: str) -> int:
    """A stable 64-bit hash of ``text`` (BLAKE2b-64, personalised): the same in every process and version."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=_HASH_PERSON).digest()
    return int.from_bytes(digest, "big")


class HashRing:
    """Maps keys (namespaces) to one of ``replicas`` (distinct non-empty addresses, any order): ``vnodes``
    points per replica; a key belongs to the first point at or after its hash, wrapping around."""

    def __init__(self, replicas: Iterable[str], *, vnodes: int = DEFAULT_VNODES) -> None:
        names = list(replicas)
        if not names:
            raise ValueError("a hash ring needs at least one replica")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"a replica must be a non-empty string, got {name!r}")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"replicas listed twice: {', '.join(duplicates)}")
        self.vnodes = vnodes
        self.replicas: tuple[str, ...] = tuple(sorted(names))
        points = sorted((ring_hash(f"{name}#{i}"), name) for name in self.replicas for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [name for _, name in points]

    def replica_for(self, key: str) -> str:
        """The replica that serves ``key``."""
        i = bisect.bisect_left(self._hashes, ring_hash(key))
        return self._owners[i % len(self._owners)]

    def replicas_for(self, key: str) -> list[str]:
        """Every replica in the order ``key`` falls back to them: the first owner of each point met going
        round the ring from ``key``'s hash. ``replicas_for(key)[1]`` is what the ring without
        ``replica_for(key)`` picks for ``key``."""
        start = bisect.bisect_left(self._hashes, ring_hash(key))
        order: dict[str, None] = {}
        for j in range(len(self._owners)):
            order.setdefault(self._owners[(start + j) % len(self._owners)])
            if len(order) == len(self.replicas):
                break
        return list(order)

    def __len__(self) -> int:
        return len(self.replicas)

    def __contains__(self, replica: object) -> bool:
        return replica in self.replicas

    def with_replica(self, replica: str) -> HashRing:
        return HashRing((*self.replicas, replica), vnodes=self.vnodes)

    def without_replica(self, replica: str) -> HashRing:
        if replica not in self.replicas:
            raise ValueError(f"{replica!r} is not on the ring")
        return HashRing((r for r in self.replicas if r != replica), vnodes=self.vnodes)


class ReplicatedPrefixClient:
    """PrefixClient calls over several replicas, re-homed while one answers UNAVAILABLE. ``client_kwargs``
    (``owner``, ``token``, ``tls_ca``, ...) are PrefixClient's; ``clients``: already built clients by
    replica; ``retry_after_s``: how long a failed replica is passed over; ``clock``: monotonic seconds."""

    def __init__(
        self,
        replicas: Sequence[str],
        *,
        vnodes: int = DEFAULT_VNODES,
        clients: Mapping[str, Any] | None = None,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        **client_kwargs: Any,
    ) -> None:
        self.ring = HashRing(replicas, vnodes=vnodes)
        given = dict(clients or {})
        unknown = sorted(set(given) - set(self.ring.replicas))
        if unknown:
            raise ValueError(f"clients given for replicas not in the list: {', '.join(unknown)}")
        security = ClientSecurity(*(client_kwargs.get(k) for k in ("token", "tls_ca", "tls_cert", "tls_key")))
        self._channels = {  # reconnecting quickly: a replica that is back is used within a second
            r: security.channel(r, RECONNECT_OPTIONS) for r in self.ring.replicas if r not in given
        }
        self.clients = {
            r: given[r] if r in given else PrefixClient(self._channels[r], **client_kwargs)
            for r in self.ring.replicas
        }
        self.retry_after_s, self._clock = retry_after_s, clock
        self._lock = threading.Lock()
        self._down_until: dict[str, float] = {}
        self.rehomed = 0  # calls served by a replica other than their namespace's own

    def replica_for(self, namespace: str = "") -> str:
        """The replica that serves ``namespace`` now: its own unless that one is passed over."""
        return self._order(namespace)[0]

    def client_for(self, namespace: str = ""):
        """The PrefixClient of the replica that serves ``namespace`` now."""
        return self.clients[self.replica_for(namespace)]

    def down(self) -> list[str]:
        """The replicas passed over now (they answered UNAVAILABLE less than ``retry_after_s`` ago)."""
        now = self._clock()
        with self._lock:
            return sorted(r for r, until in self._down_until.items() if until > now)

    def lookup(self, tokens: Sequence[int] | None = None, *, namespace: str = "", **kwargs: Any):
        return self._call(namespace, lambda c: c.lookup(tokens, namespace=namespace, **kwargs))

    def insert(self, tokens: Sequence[int], session: str, *, namespace: str = "", **kwargs: Any) -> bool:
        return self._call(namespace, lambda c: c.insert(tokens, session, namespace=namespace, **kwargs))

    def insert_detailed(self, tokens: Sequence[int], session: str, *, namespace: str = "", **kwargs: Any):
        return self._call(
            namespace, lambda c: c.insert_detailed(tokens, session, namespace=namespace, **kwargs)
        )

    def generate(self, tokens: Sequence[int] | None = None, *, namespace: str = "", **kwargs: Any):
        """The gateway stream of the replica that serves ``namespace``; one that fails with
        UNAVAILABLE before the first event passes the call to the next (a :class:`RehomingStream`)."""
        return RehomingStream(self, namespace, lambda c: c.generate(tokens, namespace=namespace, **kwargs))

    def stats(self) -> dict[str, Any]:
        """Each replica's PrefixServiceStats, by address."""
        return {r: c.stats() for r, c in self.clients.items()}

    def clear(self) -> int:
        """Clear every replica; the number of entries released in all."""
        return sum(c.clear() for c in self.clients.values())

    def close(self) -> None:
        """Close the clients this object built (not those passed in ``clients``)."""
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> ReplicatedPrefixClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- re-homing -------------------------------------------------------------------------------
    def _order(self, namespace: str) -> list[str]:
        """The replicas to try for ``namespace``: the ring's order, those passed over last (all of them
        when every replica is passed over: one may be back)."""
        order = self.ring.replicas_for(namespace)
        down = set(self.down())
        return [r for r in order if r not in down] + [r for r in order if r in down]

    def _failed(self, replica: str, exc: Unavailable) -> None:
        with self._lock:
            self._down_until[replica] = self._clock() + self.retry_after_s
        log.info(
            "prefix replica %s unavailable (%s): passed over for %.1f s", replica, exc, self.retry_after_s
        )

    def _served(self, namespace: str, replica: str) -> None:
        with self._lock:
            self._down_until.pop(replica, None)
            if replica != self.ring.replica_for(namespace):
                self.rehomed += 1

    def _call(self, namespace: str, call: Callable[[Any], Any]) -> Any:
        order = self._order(namespace)
        for i, replica in enumerate(order):
            try:
                result = call(self.clients[replica])
            except Unavailable as exc:
                self._failed(replica, exc)
                if i == len(order) - 1:
                    raise
                continue
            self._served(namespace, replica)
            return result
        raise Unavailable("no prefix replica")  # unreachable: the ring has at least one replica


class RehomingStream:
    """A gateway Generate over the replicas of one namespace: iterating starts it on the first replica
    that does not fail with UNAVAILABLE before its first event; later errors propagate. ``replica``:
    the one serving it (once started). ``cancel()`` and ``collect()`` as GenerationStream's."""

    def __init__(self, owner: ReplicatedPrefixClient, namespace: str, start: Callable[[Any], Any]) -> None:
        self._owner, self._namespace, self._start = owner, namespace, start
        self._stream: Any = None
        self.replica = ""

    def __iter__(self) -> Iterator[Any]:
        order = self._owner._order(self._namespace)
        for i, replica in enumerate(order):
            stream = self._start(self._owner.clients[replica])
            self._stream = stream
            events = iter(stream)
            try:
                first = next(events)
            except StopIteration:
                return
            except Unavailable as exc:
                self._owner._failed(replica, exc)
                if i == len(order) - 1:
                    raise
                continue
            self.replica = replica
            self._owner._served(self._namespace, replica)
            yield first
            yield from events
            return

    def cancel(self) -> None:
        if self._stream is not None:
            self._stream.cancel()

    def collect(self):
        from clients.engine_client import GenerationStream

        return GenerationStream.collect(self)  # type: ignore[arg-type]  # iterates self
