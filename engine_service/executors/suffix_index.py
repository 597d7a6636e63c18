"""SuffixIndex: drafts across requests (``--speculative suffix``). Per owner scope, the recent texts
(prompt + answer of sessions that closed) and a map from each n-gram to where it last occurred, so a
repeated answer, an edited document or a tool loop drafts what an earlier request of the same owner
produced. One owner's texts never draft for another (nothing of theirs shows, not even as speed); each
scope holds at most ``max_tokens``, and at most ``max_scopes`` scopes are kept (least recently used
dropped), so no owner grows it at the others' expense beyond their own index's reuse."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

NGRAM = 3  # tokens of context a draft must match
MAX_TOKENS = 1 << 16  # per scope
MAX_SCOPES = 256


@dataclass
class _Scope:
    texts: OrderedDict[int, tuple[int, ...]] = field(default_factory=OrderedDict)  # oldest first
    grams: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # -> (text, index after)
    tokens: int = 0


class SuffixIndex:
    """See the module docstring. Engine thread only (no lock)."""

    def __init__(self, n: int = NGRAM, max_tokens: int = MAX_TOKENS, max_scopes: int = MAX_SCOPES) -> None:
        self.n, self.max_tokens, self.max_scopes = n, max_tokens, max_scopes
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()
        self._next = 0

    def add(self, scope: str, tokens: Sequence[int]) -> None:
        """Index ``tokens`` (a closed session's text; positions without a token, < 0, never match)."""
        text = tuple(tokens)[-self.max_tokens :]
        if len(text) <= self.n:
            return
        s = self._scopes.pop(scope, None) or _Scope()
        self._scopes[scope] = s  # most recently used last
        while len(self._scopes) > self.max_scopes:
            self._scopes.popitem(last=False)
        self._next += 1
        s.texts[self._next] = text
        s.tokens += len(text)
        n = self.n
        for end in range(n, len(text)):
            gram = text[end - n : end]
            if min(gram) >= 0:
                s.grams[gram] = (self._next, end)
        while s.tokens > self.max_tokens:
            self._evict(s)

    def _evict(self, s: _Scope) -> None:
        tid, text = s.texts.popitem(last=False)
        s.tokens -= len(text)
        n = self.n
        for end in range(n, len(text)):
            gram = text[end - n : end]
            if s.grams.get(gram, (0, 0))[0] == tid:
                del s.grams[gram]

    def draft(self, scope: str, context: Sequence[int], budget: int) -> tuple[int, ...]:
        """Up to ``budget`` tokens that followed the context's last n-gram where it last occurred in
        ``scope``'s texts (() when it never did)."""
        s = self._scopes.get(scope)
        if s is None or len(context) < self.n or budget < 1:
            return ()
        hit = s.grams.get(tuple(context[-self.n :]))
        if hit is None:
            return ()
        tid, end = hit
        following = s.texts[tid][end : end + budget]
        cut = next((i for i, t in enumerate(following) if t < 0), len(following))
        return following[:cut]

    def held_tokens(self, scope: str) -> int:
        s = self._scopes.get(scope)
        return 0 if s is None else s.tokens
