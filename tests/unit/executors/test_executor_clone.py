"""ModuleExecutor.clone: exact prefix, refusals leave the source unchanged, a lying cache is undone."""

from __future__ import annotations

import pytest

from engine_service.executors.base import ExecInput
from engine_service.executors.module import ModuleExecutor
from tests.unit.executors.helpers import greedy_decode, prefill, reference_greedy

KINDS = ("batched-sequence", "batched-cell")
PROMPT = [17, 4, 99, 23, 56, 8, 71, 30, 12, 64, 5]


@pytest.fixture
def model(tiny_model):
    return tiny_model("FRFR", window=4, tie_embeddings=False)


def make(model, kind="batched-sequence", **kw):
    kw.setdefault("max_sessions", 4)
    kw.setdefault("max_session_tokens", 128)
    return ModuleExecutor.create(model, kind, **kw)


def source_continues_unchanged(ex, model, sid, first) -> None:
    """The source still decodes exactly what an undisturbed greedy run would."""
    assert greedy_decode(ex, sid, first, 6) == reference_greedy(model, PROMPT, 6)[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("upto", [0, 1, 5, len(PROMPT)])
def test_clone_holds_exactly_the_prefix(model, kind, upto) -> None:
    ex = make(model, kind)
    src = ex.open_session()
    first = prefill(ex, src, PROMPT)
    child = ex.clone(src, upto)
    assert child is not None and ex.position(child) == upto
    suffix = [40, 41, 42]
    out = ex.execute([ExecInput(child, upto, tokens=tuple(suffix))])[0]
    assert greedy_decode(ex, child, out.tokens, 4) == reference_greedy(model, PROMPT[:upto] + suffix, 4)[0]
    source_continues_unchanged(ex, model, src, first)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("upto", [-1, len(PROMPT) + 1, 10**6])
def test_refused_boundaries_leave_the_source_unchanged(model, kind, upto) -> None:
    ex = make(model, kind)
    src = ex.open_session()
    first = prefill(ex, src, PROMPT)
    assert ex.clone(src, upto) is None
    assert ex.resident_sessions == 1 and ex.position(src) == len(PROMPT)
    source_continues_unchanged(ex, model, src, first)


def test_evicted_ring_boundary_is_refused(model) -> None:
    ex = make(model, "batched-sequence", prefill_chunk=1)  # window 4 + max_write 1 - 1 = 4 slots
    src = ex.open_session()
    first = prefill(ex, src, PROMPT)
    assert ex.clone(src, 5) is None
    assert ex.clone(src, len(PROMPT) - 1) is not None  # still inside the ring: allowed
    source_continues_unchanged(ex, model, src, first)


def test_unknown_source_is_refused(model) -> None:
    assert make(model).clone(12345, 0) is None


class LyingCache:
    """Delegates to a real cache but misreports or breaks clones on demand."""

    def __init__(self, inner, mode: str) -> None:
        self.inner = inner
        self.mode = mode
        self.lied_about: list[int] = []
        self.removed: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def max_seqs(self):
        return self.inner.max_seqs

    @property
    def capacity(self):
        return self.inner.capacity

    def seq_clone(self, src, upto):
        if self.mode == "raise":
            raise RuntimeError("allocation failed")
        # "short": really clone one position less than asked, then report it honestly
        child = self.inner.seq_clone(src, upto - 1 if self.mode == "short" else upto)
        self.lied_about.append(child)
        return child

    def pos(self, seq):
        if self.mode == "long" and seq in self.lied_about:
            return self.inner.pos(seq) + 1
        return self.inner.pos(seq)

    def seq_rm(self, seq):
        self.removed.append(seq)
        self.inner.seq_rm(seq)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["short", "long", "raise"])
def test_clone_position_mismatch_or_exception_is_undone(model, kind, mode) -> None:
    honest = make(model, kind)
    cache = LyingCache(honest.cache, mode)
    ex = ModuleExecutor(model, cache, cache_kind=kind, max_sessions=4, max_session_tokens=128)
    src = ex.open_session()
    first = prefill(ex, src, PROMPT)
    assert ex.clone(src, 6) is None
    assert cache.removed == cache.lied_about  # the bad child was released, nothing else
    assert ex.resident_sessions == 1
    source_continues_unchanged(ex, model, src, first)
    # negative control: the same cache in honest mode clones fine
    cache.mode = "honest"
    assert ex.clone(src, 6) is not None
