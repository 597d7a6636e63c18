"""Keeping a prefix namespace on one prefix-service replica: a consistent-hash ring over replica addresses.

Several ``forkline-prefix`` replicas may share the same engines, each with its own cache. A namespace
whose requests always reach the same replica finds its prompts there; spread over replicas it would be
computed and stored once per replica. Clients therefore pick the replica by consistent hashing on the
namespace, and every call carries the namespace in the ``forkline-route-key`` header (:data:`ROUTE_KEY_HEADER`)
so a proxy in front of the replicas (Envoy or Istio ring hash on that header) can do the same.

:class:`HashRing` places :data:`DEFAULT_VNODES` points per replica on a 64-bit ring (BLAKE2b of
``"<address>#<i>"``, not Python's per-process ``hash()``), so the mapping is the same in every process,
and adding or removing one of N replicas moves only about 1/N of the keys (those whose arc changed
hands). :class:`ReplicatedPrefixClient` holds one :class:`~clients.prefix_client.PrefixClient` per
replica and forwards each call to the replica the ring picks for its namespace.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ROUTE_KEY_HEADER = "forkline-route-key"  # gRPC metadata key: the namespace a call belongs to
DEFAULT_VNODES = 128  # points per replica: with 128, each replica's share of keys is within ~10% of 1/N
_HASH_PERSON = b"forkline-ring-v1"  # BLAKE2b personalisation: the ring's hash is its own


def ring_hash(text: str) -> int:
    """A stable 64-bit hash of ``text`` (BLAKE2b-64, personalised): the same in every process and version."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=_HASH_PERSON).digest()
    return int.from_bytes(digest, "big")


class HashRing:
    """A consistent-hash ring mapping keys (namespaces) to one of ``replicas`` (addresses).

    Each replica owns ``vnodes`` points; a key belongs to the first point at or after its hash, wrapping
    around. Replicas must be distinct non-empty strings; their order does not matter.
    """

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
    """PrefixClient calls over several prefix-service replicas: a namespace always goes to one replica.

    ``replicas`` are ``host:port`` addresses (the same replica set, in any order, gives every client the
    same mapping). The keyword arguments (``owner``, ``token``, ``tls_ca``, ...) are PrefixClient's and
    apply to every replica. ``clients`` maps a replica to an already built client instead (tests, or
    channels the caller owns).
    """

    def __init__(
        self,
        replicas: Sequence[str],
        *,
        vnodes: int = DEFAULT_VNODES,
        clients: Mapping[str, Any] | None = None,
        **client_kwargs: Any,
    ) -> None:
        from clients.prefix_client import PrefixClient

        self.ring = HashRing(replicas, vnodes=vnodes)
        given = dict(clients or {})
        unknown = sorted(set(given) - set(self.ring.replicas))
        if unknown:
            raise ValueError(f"clients given for replicas not in the list: {', '.join(unknown)}")
        self.clients = {
            r: given[r] if r in given else PrefixClient(r, **client_kwargs) for r in self.ring.replicas
        }
        self._owned = [r for r in self.ring.replicas if r not in given]

    def replica_for(self, namespace: str = "") -> str:
        return self.ring.replica_for(namespace)

    def client_for(self, namespace: str = ""):
        """The PrefixClient of the replica that serves ``namespace``."""
        return self.clients[self.ring.replica_for(namespace)]

    def lookup(self, tokens: Sequence[int] | None = None, *, namespace: str = "", **kwargs: Any):
        return self.client_for(namespace).lookup(tokens, namespace=namespace, **kwargs)

    def insert(self, tokens: Sequence[int], session: str, *, namespace: str = "", **kwargs: Any) -> bool:
        return self.client_for(namespace).insert(tokens, session, namespace=namespace, **kwargs)

    def insert_detailed(self, tokens: Sequence[int], session: str, *, namespace: str = "", **kwargs: Any):
        return self.client_for(namespace).insert_detailed(tokens, session, namespace=namespace, **kwargs)

    def generate(self, tokens: Sequence[int] | None = None, *, namespace: str = "", **kwargs: Any):
        return self.client_for(namespace).generate(tokens, namespace=namespace, **kwargs)

    def stats(self) -> dict[str, Any]:
        """Each replica's PrefixServiceStats, by address."""
        return {r: c.stats() for r, c in self.clients.items()}

    def clear(self) -> int:
        """Clear every replica; the number of entries released in all."""
        return sum(c.clear() for c in self.clients.values())

    def close(self) -> None:
        """Close the clients this object built (not those passed in ``clients``)."""
        for replica in self._owned:
            self.clients[replica].close_channel()

    def __enter__(self) -> ReplicatedPrefixClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
