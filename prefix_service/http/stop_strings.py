"""Stop strings on a detokenized stream (OpenAI's ``stop``, matched on text): the matcher holds back the
tail that could still grow into a stop string and never returns the stop string itself."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """``push(delta) -> (text to emit now, stopped)``; ``flush()`` returns the held-back tail at the end
    of a generation that did not stop on a string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        # The held tail never contains a whole stop string, so a match here is the earliest new one.
        hits = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self._held, self.stopped = "", True
            return text[:at], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for length in range(min(len(text), max(len(s) for s in self._stops) - 1), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0
