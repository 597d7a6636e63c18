"""Exact tokenization of long SentencePiece texts by pieces cut where no token can span, each piece's
ids kept per cache scope: a repeated prefix is tokenized once. Spec: docs/MODELS.md (Chunked encoding)."""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable

SPACE = "\u2581"
STRIDE = 512  # characters between cuts, at least (~100 tokens of English)


def piece_cut(vocab: Iterable[str], added: Iterable[str]) -> re.Pattern[str] | None:
    """Where a text may be cut: a lone space after no character a token joins to a following ``▁``
    (nor an added token's last one), before a character that starts no added token. Added tokens of
    spaces only (Gemma's runs of 2-31) never match a lone space; None where another added token holds
    a space (it could span a cut)."""
    added = [a for a in added if a]
    if any((" " in a and a.strip(" ")) or SPACE in a or a == " " for a in added):
        return None
    added = [a for a in added if " " not in a]
    joined = {t[i - 1] for t in vocab if SPACE in t[1:] for i in range(1, len(t)) if t[i] == SPACE}
    before = (joined - {SPACE}) | {a[-1] for a in added} | {" ", SPACE}
    after = {a[0] for a in added} | {" ", SPACE}
    return re.compile(f"(?<![{_chars(before)}]) (?=[^{_chars(after)}])")


def _chars(chars: Iterable[str]) -> str:
    return "".join(re.escape(c) for c in sorted(chars))


def cuts(text: str, cut: re.Pattern[str], stride: int = STRIDE) -> list[int]:
    """The cut positions of ``text`` (each a space that starts the next piece)."""
    found, at = [], stride
    while at < len(text) and (m := cut.search(text, at)) is not None:
        found.append(m.start())
        at = m.start() + stride
    return found


class PieceCache:
    """Per-owner LRU caches of piece ids, bounded in characters per owner and in all; the least recently
    active owner's oldest pieces go first when the total is over. Thread-safe."""

    def __init__(self, owner_chars: int = 1 << 20, total_chars: int = 8 << 20) -> None:
        self.owner_chars, self.total_chars = owner_chars, total_chars
        self._owners: OrderedDict[str, OrderedDict[tuple[bool, str], array]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._total = 0
        self._lock = threading.Lock()
        self.reused_chars = self.tokenized_chars = 0  # text answered from the cache / tokenized

    def get(self, owner: str, key: tuple[bool, str]) -> array | None:
        with self._lock:
            pieces = self._owners.get(owner)
            if pieces is None or (ids := pieces.get(key)) is None:
                self.tokenized_chars += len(key[1])
                return None
            pieces.move_to_end(key)
            self._owners.move_to_end(owner)
            self.reused_chars += len(key[1])
            return ids

    def put(self, owner: str, key: tuple[bool, str], ids: array) -> None:
        size = len(key[1])
        if size > self.owner_chars // 8:
            return  # a piece without cuts this long is not kept
        with self._lock:
            pieces = self._owners.setdefault(owner, OrderedDict())
            self._owners.move_to_end(owner)
            if key in pieces:
                return
            pieces[key] = ids
            self._sizes[owner] = self._sizes.get(owner, 0) + size
            self._total += size
            while self._sizes[owner] > self.owner_chars:
                self._evict(owner)
            while self._total > self.total_chars:
                self._evict(next(iter(self._owners)))

    def _evict(self, owner: str) -> None:
        pieces = self._owners[owner]
        (_, text), _ = pieces.popitem(last=False)
        self._sizes[owner] -= len(text)
        self._total -= len(text)
        if not pieces:
            del self._owners[owner], self._sizes[owner]


class ChunkedEncoder:
    """``encode`` as the tokenizer's, by pieces, through ``owner``'s cache. ``piece_ids(piece, first)``
    tokenizes one piece (``first``: the text's start)."""

    def __init__(
        self,
        piece_ids: Callable[[str, bool], list[int]],
        cut: re.Pattern[str],
        cache: PieceCache,
        owner: str,
        finish: Callable[[list[int], bool], list[int]],
    ) -> None:
        self._piece_ids, self._cut, self._cache, self._owner = piece_ids, cut, cache, owner
        self._finish = finish  # the tokenizer's BOS rule

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        bounds = [0, *cuts(text, self._cut, STRIDE), len(text)]
        for start, end in zip(bounds, bounds[1:], strict=False):
            ids.extend(self._piece(text[start:end], start == 0))
        return self._finish(ids, add_special_tokens)

    def _piece(self, piece: str, first: bool) -> array | list[int]:
        key = (first, piece)
        ids = self._cache.get(self._owner, key)
        if ids is None:
            ids = array("i", self._piece_ids(piece, first))
            self._cache.put(self._owner, key, ids)
        return ids
