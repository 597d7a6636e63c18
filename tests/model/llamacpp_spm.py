"""llama.cpp's SentencePiece tokenizer loop in plain Python, written for the tests from its description:
an independent reference for the engine's GGUF SentencePiece tokenizers."""

from __future__ import annotations

import heapq

SPACE = "\u2581"


class LlamaCppSpm:
    """llama.cpp's SentencePiece path, naively: cut control / unknown / user-defined token texts out of
    the text (longest token first, each left to right), then per remaining piece: a prefix space when
    ``add_space_prefix`` and the piece starts the text or follows a cut-out token, spaces -> "▁", one
    symbol per character, repeatedly merge the adjacent pair whose concatenation is a token of the
    highest score (ties: leftmost), and write symbols that are not tokens as <0xXX> byte tokens."""

    def __init__(self, tokens, scores, types, add_space_prefix: bool) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.scores = scores
        cut = [(t, i) for i, t in enumerate(tokens) if types[i] in (2, 3, 4)]
        self.cut = sorted(cut, key=lambda ti: -len(ti[0].encode()))
        self.add_space_prefix = add_space_prefix

    def _pieces(self, text: str) -> list:
        pieces: list = [text] if text else []
        for token, tid in self.cut:
            out: list = []
            for p in pieces:
                if not isinstance(p, str) or token not in p:
                    out.append(p)
                    continue
                pos = 0
                while (j := p.find(token, pos)) >= 0:
                    out += [p[pos:j], tid] if j > pos else [tid]
                    pos = j + len(token)
                if pos < len(p):
                    out.append(p[pos:])
            pieces = out
        return pieces

    def _merge(self, text: str) -> list[int]:
        vocab, scores = self.vocab, self.scores
        sym = list(text)
        nxt, prv, alive = list(range(1, len(sym))) + [-1], list(range(-1, len(sym) - 1)), [True] * len(sym)
        heap: list = []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0 and (tid := vocab.get(sym[left] + sym[right])) is not None:
                heapq.heappush(heap, (-scores[tid], left, right, len(sym[left]) + len(sym[right])))

        for i in range(1, len(sym)):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not (alive[left] and alive[right]) or len(sym[left]) + len(sym[right]) != size:
                continue  # one side changed since the pair was queued
            sym[left] += sym[right]
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        ids: list[int] = []
        i = 0 if sym else -1
        while i >= 0:
            t = sym[i]
            ids += [vocab[t]] if t in vocab else [vocab[f"<0x{b:02X}>"] for b in t.encode()]
            i = nxt[i]
        return ids

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        after_cut = True
        for p in self._pieces(text):
            if isinstance(p, int):
                ids.append(p)
                after_cut = True
            else:
                prefix = " " if self.add_space_prefix and after_cut else ""
                ids += self._merge((prefix + p).replace(" ", SPACE))
                after_cut = False
        return ids
