"""TokenIndex: a radix tree (compressed edges) of token keys per namespace with opaque values and ranks;
:meth:`TokenIndex.matches` yields the stored keys sharing a prefix with a request, longest common
prefix first, then highest rank, touching only the nodes that can hold them. Plain Python."""

from __future__ import annotations

import heapq
import itertools
import operator
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from engine_service.api.errors import InvalidArgument

V = TypeVar("V")

_NO_VALUE: Any = object()


class _Node:
    __slots__ = ("edge", "children", "value", "rank", "bound")

    def __init__(self, edge: tuple[int, ...]) -> None:
        self.edge = edge  # the token run from the parent
        self.children: dict[int, _Node] = {}  # keyed by the first token of each child's edge
        self.value: Any = _NO_VALUE
        self.rank = 0
        # an upper bound on the rank of any value below: exact after inserts and touches, maybe
        # stale-high after removals (which only costs an extra heap pop)
        self.bound = -1


@dataclass(frozen=True)
class IndexMatch(Generic[V]):
    """A stored ``value`` whose key shares its first ``common`` tokens with the request (``common >= 1``)."""

    value: V
    common: int


def common_prefix(edge: Sequence[int], key: Sequence[int], start: int = 0) -> int:
    """Leading tokens shared by ``edge`` and ``key[start:]``."""
    segment = key[start : start + len(edge)]
    if segment == edge:  # the common case, compared in C
        return len(edge)
    shared = 0
    for a, b in zip(edge, segment, strict=False):
        if a != b:
            break
        shared += 1
    return shared


class TokenIndex(Generic[V]):
    """Maps ``(namespace, key)`` to one value; finds shared prefixes. Not thread-safe (callers lock)."""

    def __init__(self) -> None:
        self._roots: dict[Hashable, _Node] = {}
        self._size = 0
        self._edges: dict[Hashable, int] = {}  # per namespace: the tree's total edge length
        self._all_edges = 0  # their sum: what the budget reads on every check

    def edge_positions(self, namespace: Hashable | None = None) -> int:
        """Positions an ideal radix tree of the stored keys holds (its total edge length: every
        distinct stored prefix once), of ``namespace`` or of all."""
        return self._edges.get(namespace, 0) if namespace is not None else self._all_edges

    def __len__(self) -> int:
        return self._size

    def insert(self, namespace: Hashable, key: Sequence[int], value: V, rank: int) -> V | None:
        """Store ``value`` under ``key``; returns the value it replaced, or None."""
        key = tuple(key)
        if not key:
            raise ValueError("TokenIndex key must not be empty")
        node = self._roots.setdefault(namespace, _Node(()))
        path = [node]
        depth = 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = _Node(key[depth:])
                node.children[key[depth]] = child
                self._edges[namespace] = self._edges.get(namespace, 0) + len(key) - depth
                self._all_edges += len(key) - depth
                depth = len(key)
            else:
                shared = common_prefix(child.edge, key, depth)
                if shared < len(child.edge):
                    # Split the edge: a new inner node holds the shared part.
                    inner = _Node(child.edge[:shared])
                    inner.bound = child.bound
                    child.edge = child.edge[shared:]
                    inner.children[child.edge[0]] = child
                    node.children[key[depth]] = inner
                    child = inner
                depth += shared
            node = child
            path.append(node)
        previous = node.value
        node.value = value
        node.rank = rank
        for step in path:
            step.bound = max(step.bound, rank)
        if previous is _NO_VALUE:
            self._size += 1
            return None
        return previous

    def get(self, namespace: Hashable, key: Sequence[int]) -> V | None:
        path = self._path(namespace, tuple(key))
        return None if path is None else path[-1].value

    def touch(self, namespace: Hashable, key: Sequence[int], rank: int) -> bool:
        """Set the rank of a stored key; False when the key is not stored."""
        path = self._path(namespace, tuple(key))
        if path is None:
            return False
        path[-1].rank = rank
        for step in path:
            step.bound = max(step.bound, rank)
        return True

    def remove(self, namespace: Hashable, key: Sequence[int]) -> V | None:
        """Drop ``key``; returns its value, or None when it was not stored."""
        path = self._path(namespace, tuple(key))
        if path is None:
            return None
        node = path[-1]
        value = node.value
        node.value = _NO_VALUE
        self._size -= 1
        self._prune(namespace, path)
        return value

    def holds(self, namespace: Hashable) -> bool:
        """Whether any key is stored under ``namespace``."""
        return namespace in self._roots  # an emptied namespace's root is pruned

    def clear(self) -> None:
        self._roots.clear()
        self._edges.clear()
        self._all_edges = 0
        self._size = 0

    def prefixes(self, namespace: Hashable, key: Sequence[int]) -> list[V]:
        """The values stored under proper prefixes of ``key``, shortest first."""
        key = tuple(key)
        node, depth, found = self._roots.get(namespace), 0, []
        while node is not None and depth < len(key):
            if depth and node.value is not _NO_VALUE:
                found.append(node.value)
            child = node.children.get(key[depth])
            if child is None or key[depth : depth + len(child.edge)] != child.edge:
                break
            node, depth = child, depth + len(child.edge)
        return found

    def below(self, namespace: Hashable, key: Sequence[int]) -> list[V]:
        """The values stored under keys that ``key`` (stored) is a proper prefix of."""
        path = self._path(namespace, tuple(key))
        if path is None:
            return []
        return [value for value in self._best_first(path[-1], None) if value is not path[-1].value]

    def forks(self, namespace: Hashable, key: Sequence[int]) -> list[int]:
        """Depths strictly inside ``key`` where stored keys part: inner nodes with several children on
        its path, and where ``key`` itself leaves the stored keys; ascending."""
        key = tuple(key)
        node, depth, found = self._roots.get(namespace), 0, []
        while node is not None and depth < len(key):
            if depth and len(node.children) > 1:
                found.append(depth)
            child = node.children.get(key[depth])
            if child is None:
                if depth and node.children and found[-1:] != [depth]:
                    found.append(depth)
                break
            shared = common_prefix(child.edge, key, depth)
            if shared < len(child.edge):
                if 0 < depth + shared < len(key):
                    found.append(depth + shared)
                break
            node, depth = child, depth + shared
        return found

    def divergence(self, namespace: Hashable, key: Sequence[int]) -> tuple[int, V | None, Iterator[V]] | None:
        """Where ``key`` leaves the stored keys: the depth ``d`` (``0 < d < len(key)``), the value
        stored exactly at ``d`` (None: none) and the values below ``d`` off ``key``'s path, best
        ranked first (lazy: the index must not change meanwhile); None when ``key`` leaves at the
        root or runs out inside the tree."""
        key = tuple(key)
        node, depth = self._roots.get(namespace), 0
        if node is None:
            return None
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            shared = common_prefix(child.edge, key, depth)
            if shared < len(child.edge):
                if depth + shared == len(key):
                    return None  # key is a prefix of the keys below
                return depth + shared, None, self._best_first(child, None)
            node, depth = child, depth + shared
        if depth == 0 or depth == len(key) or not node.children:
            return None
        at = None if node.value is _NO_VALUE else node.value
        return depth, at, (value for value in self._best_first(node, None) if value is not at)

    def values(self) -> Iterator[V]:
        """Every stored value (any order)."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.value is not _NO_VALUE:
                yield node.value
            stack.extend(node.children.values())

    def matches(self, namespace: Hashable, tokens: Sequence[int]) -> Iterator[IndexMatch[V]]:
        """Stored keys sharing at least one leading token with ``tokens``: longest common prefix first,
        then by rank; lazy (stop after the first acceptable one), and the index must not change meanwhile."""
        tokens = tuple(tokens)
        root = self._roots.get(namespace)
        if root is None or not tokens:
            return
        # Walk down while whole edges match. Every key below a walked node at depth d shares at
        # least d tokens; the ones not in the child the walk continues into share exactly d.
        groups: list[tuple[int, _Node, _Node | None]] = []  # (common, node, child on the walk)
        node, depth = root, 0
        while True:
            if depth == len(tokens):
                groups.append((depth, node, None))
                break
            child = node.children.get(tokens[depth])
            groups.append((depth, node, child))
            if child is None:
                break
            shared = common_prefix(child.edge, tokens, depth)
            if shared < len(child.edge):
                groups.append((depth + shared, child, None))  # the walk ends inside this edge
                break
            node, depth = child, depth + shared
        for common, node, walked in reversed(groups):
            if common == 0:
                break  # a first-token mismatch is not a match
            for value in self._best_first(node, walked):
                yield IndexMatch(value, common)

    # -- internals ---------------------------------------------------------------------------

    @staticmethod
    def _best_first(node: _Node, skip: _Node | None) -> Iterator[Any]:
        """The values at and below ``node`` except under ``skip``, by descending rank (a subtree is
        expanded only when its bound can still win)."""
        order = itertools.count()
        # Items are (-rank or -bound, kind, tiebreak, payload); kind 0 = value, 1 = subtree, so a
        # value comes before a subtree whose bound only ties with it.
        heap: list[tuple[int, int, int, Any]] = [
            (-child.bound, 1, next(order), child) for child in node.children.values() if child is not skip
        ]
        if node.value is not _NO_VALUE:
            heap.append((-node.rank, 0, next(order), node.value))
        heapq.heapify(heap)
        while heap:
            _, kind, _, payload = heapq.heappop(heap)
            if kind == 0:
                yield payload
                continue
            if payload.value is not _NO_VALUE:
                heapq.heappush(heap, (-payload.rank, 0, next(order), payload.value))
            for child in payload.children.values():
                heapq.heappush(heap, (-child.bound, 1, next(order), child))

    def _path(self, namespace: Hashable, key: tuple[int, ...]) -> list[_Node] | None:
        """Nodes from the root to the node storing ``key`` exactly, or None."""
        node = self._roots.get(namespace)
        if node is None or not key:
            return None
        path = [node]
        depth = 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None or key[depth : depth + len(child.edge)] != child.edge:
                return None
            node = child
            depth += len(child.edge)
            path.append(node)
        return path if node.value is not _NO_VALUE else None

    def _prune(self, namespace: Hashable, path: list[_Node]) -> None:
        """Restore the radix invariants after ``path[-1]`` lost its value: drop empty leaves and
        merge value-less inner nodes that have a single child into that child."""
        node = path[-1]
        index = len(path) - 1
        if not node.children and index > 0:
            parent = path[index - 1]
            del parent.children[node.edge[0]]
            self._edges[namespace] -= len(node.edge)
            self._all_edges -= len(node.edge)
            node, index = parent, index - 1
        if index == 0:
            if not node.children:
                del self._roots[namespace]
                self._edges.pop(namespace, None)
            return
        if node.value is _NO_VALUE and len(node.children) == 1:
            (only,) = node.children.values()
            only.edge = node.edge + only.edge
            path[index - 1].children[only.edge[0]] = only


MAX_TOKEN = 2**64 - 1


def token_key(tokens: Sequence[int], field_name: str = "tokens") -> tuple[int, ...]:
    """A validated, immutable copy of ``tokens``: ints in ``[0, 2**64)`` (numpy ints accepted), else
    InvalidArgument naming ``field_name``; empty is allowed (callers decide what it means)."""
    if isinstance(tokens, (str, bytes)):
        raise InvalidArgument(f"{field_name} must be a sequence of token ids, got {type(tokens).__name__}")
    try:
        key = tuple(map(operator.index, tokens))
    except TypeError as exc:
        raise InvalidArgument(f"{field_name} must be a sequence of integer token ids ({exc})") from None
    if key and (min(key) < 0 or max(key) > MAX_TOKEN):
        bad = next(t for t in key if t < 0 or t > MAX_TOKEN)
        raise InvalidArgument(f"{field_name} must hold ids in [0, 2**64), got {bad}")
    return key
