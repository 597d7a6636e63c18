"""HistoryGrams: where each n-gram of a session's history last ended, indexed as the history grows, so a
prompt-lookup draft costs the new tokens' n-grams per step rather than a scan of the whole history."""

from __future__ import annotations

from collections.abc import Sequence


class HistoryGrams:
    """n-grams of ``shortest``..``longest`` tokens; :meth:`cut` when the history is cut below what was
    indexed (a rewind), and the index is rebuilt at the next :meth:`find`."""

    __slots__ = ("shortest", "longest", "_ends", "_upto")

    def __init__(self, shortest: int, longest: int) -> None:
        self.shortest, self.longest = shortest, longest
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index right after its latest end
        self._upto = 0  # every n-gram ending before this is indexed

    def cut(self, length: int) -> None:
        if length < self._upto:
            self._ends.clear()
            self._upto = 0

    def find(
        self, history: Sequence[int], length: int, pending: int, budget: int, shortest: int = 0
    ) -> tuple[int, ...]:
        """Up to ``budget`` tokens that followed the latest earlier occurrence of the last n tokens of
        ``history[:length] + [pending]`` (n from ``longest`` down to ``shortest``), cut before a
        position without a token (< 0); () when none occurred."""
        self._index(history, length)
        for n in range(min(self.longest, length), max(shortest, self.shortest) - 1, -1):
            end = self._ends.get((*history[length - n + 1 : length], pending))
            if end is None:
                continue
            following = list(history[end : min(end + budget, length)])
            if len(following) < budget and end + len(following) == length:
                following.append(pending)
            cut = next((i for i, t in enumerate(following) if t < 0), len(following))
            if cut:
                return tuple(following[:cut])
        return ()

    def _index(self, history: Sequence[int], length: int) -> None:
        """Index every n-gram ending at 1..length (its continuation: history[end], or the pending token)."""
        for end in range(max(self._upto, 1), length + 1):
            for n in range(self.shortest, min(self.longest, end) + 1):
                self._ends[tuple(history[end - n : end])] = end
        self._upto = max(self._upto, length + 1)
