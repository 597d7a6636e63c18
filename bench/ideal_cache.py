"""The ideal prefix cache of the workload bench: an unbounded token trie that holds every prompt sent and,
once a request completes, its prompt + generated ids; a request's ideal hit is its longest common prefix
with the trie at send time, capped at its length - 1 (one position is always computed).

``ideal_replay(logs)`` replays the requests' send/done times; ``share(hits, lengths)`` is what the bench
reports as the ideal cache's share of prompt tokens; the trie's node count is the positions an ideal
radix tree holds for the same content (the bytes yardstick).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class TokenTrie:
    """Token sequences as a trie of dicts: ``insert`` and ``longest_prefix`` cost O(len(tokens))."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}
        self.positions = 0  # nodes: the positions a radix tree holding every inserted sequence keeps

    def insert(self, tokens: Sequence[int]) -> None:
        node = self._root
        for t in tokens:
            child = node.get(t)
            if child is None:
                child = node[t] = {}
                self.positions += 1
            node = child

    def longest_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` some inserted sequence starts with."""
        node, n = self._root, 0
        for t in tokens:
            node = node.get(t)
            if node is None:
                break
            n += 1
        return n


@dataclass(frozen=True)
class RequestLog:
    """One request as the bench saw it: prompt ids, generated ids, when it was sent and completed."""

    prompt: tuple[int, ...]
    generated: tuple[int, ...]
    sent_s: float
    done_s: float


def ideal_hits(logs: Sequence[RequestLog]) -> list[int]:
    """Each request's ideal hit, in ``logs`` order (see ``ideal_replay``)."""
    return ideal_replay(logs)[0]


def ideal_replay(logs: Sequence[RequestLog]) -> tuple[list[int], int]:
    """Each request's ideal hit, in ``logs`` order: its prefix shared with every prompt sent before it and
    every (prompt + generated) completed before it, at most len(prompt) - 1 (completions at the same time
    as a send count as before it); and the positions the ideal radix tree holds at the end."""
    events = []
    for i, log in enumerate(logs):
        events.append((log.sent_s, 1, i))
        events.append((log.done_s, 0, i))
    trie, hits = TokenTrie(), [0] * len(logs)
    for _, kind, i in sorted(events):
        log = logs[i]
        if kind == 1:
            hits[i] = max(0, min(trie.longest_prefix(log.prompt), len(log.prompt) - 1))
            trie.insert(log.prompt)
        else:
            trie.insert(log.prompt + log.generated)
    return hits, trie.positions


def share(hits: Sequence[int], lengths: Sequence[int]) -> float:
    """Reused positions over prompt positions (0.0 for no prompt positions)."""
    total = sum(lengths)
    return round(sum(hits) / total, 4) if total else 0.0
