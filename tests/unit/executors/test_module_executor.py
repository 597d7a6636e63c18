"""ModuleExecutor against the naive reference cache: commit rule, packing, rewind, gaps, clones, limits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.errors import InvalidArgument, NotFound
from engine_service.executors.base import ExecInput
from engine_service.executors.cache_setup import cache_config
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.prepared_input import EmbeddingsInput
from engine_service.executors.sampling import SamplingParams
from tests.unit.executors.helpers import CountingModel, greedy_decode, prefill, reference_greedy

KINDS = ("batched-sequence", "batched-cell")
PROMPT = [17, 4, 99, 23, 56, 8, 71, 30, 12, 64, 5]
OTHER = [3, 88, 41, 7, 19, 120, 66]


@pytest.fixture
def model(tiny_model):
    return tiny_model("FRFR", window=4, tie_embeddings=False)  # untied: greedy output does not collapse


def make(model, kind="batched-sequence", **kw):
    kw.setdefault("max_sessions", 4)
    kw.setdefault("max_session_tokens", 128)
    kw.setdefault("kv_dtype", "float32")  # compared with the float32 reference forward
    return ModuleExecutor.create(model, kind, keep_logits=True, **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_match_the_reference(model, kind) -> None:
    want, want_logits = reference_greedy(model, PROMPT, 10)
    assert len(set(want)) > 2  # a varied continuation, so order bugs would show
    ex = make(model, kind)
    sid = ex.open_session()
    logits: list = []
    first = ex.execute([ExecInput(sid, 0, tokens=tuple(PROMPT))])[0]
    logits.append(np.array(first.logits))
    assert greedy_decode(ex, sid, first.tokens, 10, logits) == want
    np.testing.assert_allclose(np.stack(logits), np.stack(want_logits), atol=1e-4)
    # commit rule: the prompt and every fed-back token are committed, the last prediction is pending
    assert ex.position(sid) == len(PROMPT) + 9


@pytest.mark.parametrize("kind", KINDS)
def test_batch_is_one_forward_with_per_session_results(model, kind) -> None:
    counting = CountingModel(model)
    ex = make(counting, kind)
    a, b, c = ex.open_session(), ex.open_session(), ex.open_session()
    outs = ex.execute(
        [
            ExecInput(a, 0, tokens=tuple(PROMPT)),
            ExecInput(b, 0, tokens=tuple(OTHER)),
            ExecInput(c, 0, tokens=tuple(OTHER[:4]), want_output=False),
        ]
    )
    assert counting.calls == [len(PROMPT) + len(OTHER) + 4]
    assert outs[2].tokens == () and ex.position(c) == 4
    ta, tb = [outs[0].tokens[0]], [outs[1].tokens[0]]
    for _ in range(5):  # decode a and b together: one forward of 2 rows per step
        counting.calls.clear()
        o = ex.execute(
            [ExecInput(a, ex.position(a), tokens=(ta[-1],)), ExecInput(b, ex.position(b), tokens=(tb[-1],))]
        )
        assert counting.calls == [2]
        ta.append(o[0].tokens[0])
        tb.append(o[1].tokens[0])
    assert ta == reference_greedy(model, PROMPT, 6)[0]
    assert tb == reference_greedy(model, OTHER, 6)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_long_input_is_split_at_max_write(model, kind) -> None:
    counting = CountingModel(model)
    ex = make(counting, kind, prefill_chunk=4)  # max_write 4: 11 positions -> 4 + 4 + 3
    sid = ex.open_session()
    first = prefill(ex, sid, PROMPT)
    assert counting.calls == [4, 4, 3]
    assert greedy_decode(ex, sid, first, 6) == reference_greedy(model, PROMPT, 6)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_start_below_position_rewinds_and_overwrites(model, kind) -> None:
    ex = make(model, kind)
    sid = ex.open_session()
    first = prefill(ex, sid, PROMPT)
    greedy_decode(ex, sid, first, 4)
    suffix = [9, 10, 11]
    out = ex.execute([ExecInput(sid, 6, tokens=tuple(suffix))])[0]
    assert ex.position(sid) == 9
    assert greedy_decode(ex, sid, out.tokens, 5) == reference_greedy(model, PROMPT[:6] + suffix, 5)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_gap_fails_only_that_input(model, kind) -> None:
    ex = make(model, kind)
    a, b = ex.open_session(), ex.open_session()
    prefill(ex, a, PROMPT[:3])
    outs = ex.execute([ExecInput(a, 5, tokens=(1, 2)), ExecInput(b, 0, tokens=tuple(OTHER))])
    assert outs[0].error and "gap" in outs[0].error and outs[0].tokens == ()
    assert ex.position(a) == 3
    assert outs[1].error is None and outs[1].tokens[0] == reference_greedy(model, OTHER, 1)[0][0]


def test_rewind_past_evicted_ring_rows_fails_the_input(model) -> None:
    ex = make(model, "batched-sequence", prefill_chunk=1)  # ring of window 4 keeps 4 slots
    sid = ex.open_session()
    prefill(ex, sid, PROMPT)
    out = ex.execute([ExecInput(sid, 5, tokens=(1,))])[0]
    assert out.error and "rewind" in out.error
    assert ex.position(sid) == len(PROMPT)


def test_bad_inputs_fail_alone(model) -> None:
    ex = make(model)
    a, b, c = ex.open_session(), ex.open_session(), ex.open_session()
    outs = ex.execute(
        [
            ExecInput(a, 0, tokens=(1, 500)),
            ExecInput(999, 0, tokens=(1,)),
            ExecInput(b, 0, tokens=(1, 2)),
            ExecInput(b, 2, tokens=(3,)),
            ExecInput(c, 0, prepared=EmbeddingsInput(mx.zeros((2, 64)))),
        ]
    )
    assert "vocabulary" in outs[0].error
    assert "unknown session" in outs[1].error
    assert outs[2].error is None and len(outs[2].tokens) == 1
    assert "twice" in outs[3].error
    assert "does not accept" in outs[4].error
    assert not ex.accepts(EmbeddingsInput(mx.zeros((2, 64))))
    assert ex.position(a) == 0 and ex.position(b) == 2 and ex.position(c) == 0


def test_max_session_tokens_is_enforced_per_input(model) -> None:
    ex = make(model, max_session_tokens=8)
    sid = ex.open_session()
    out = ex.execute([ExecInput(sid, 0, tokens=tuple(range(9)))])[0]
    assert "max_session_tokens" in out.error and ex.position(sid) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_open_respects_max_sessions(model, kind) -> None:
    ex = make(model, kind, max_sessions=2)
    a, b = ex.open_session(), ex.open_session()
    assert a is not None and b is not None and ex.open_session() is None
    assert ex.clone(a, 0) is None  # a clone needs a resident slot too
    ex.close_session(a)
    ex.close_session(a)  # unknown ids are ignored
    assert ex.open_session() is not None
    with pytest.raises(NotFound):
        ex.position(a)


def test_creation_checks_name_the_field(model) -> None:
    with pytest.raises(InvalidArgument, match="max_sessions"):
        ModuleExecutor.create(model, max_sessions=0)
    with pytest.raises(InvalidArgument, match="max_session_tokens"):
        ModuleExecutor.create(model, max_session_tokens=-5)
    with pytest.raises(InvalidArgument, match="overflow"):
        ModuleExecutor.create(model, max_sessions=2**20, max_session_tokens=4096)
    context = model.config.context_length  # a session longer than the context is capped there
    assert ModuleExecutor.create(model, max_session_tokens=context + 1).limits().max_session_tokens == context
    with pytest.raises(InvalidArgument, match="context_length"):  # the cache geometry itself refuses it
        cache_config(model.config, max_sessions=1, max_session_tokens=context + 1)
    with pytest.raises(InvalidArgument, match="cache_kind"):
        ModuleExecutor.create(model, "no-such-cache")
    ok = ModuleExecutor.create(model, "batched-cell", max_sessions=300, max_session_tokens=16)
    assert ok.limits().max_sessions == 300 and ok.cache.capacity >= 300 * 16


def test_fingerprint_tracks_execution_configuration(tiny_model) -> None:
    m = tiny_model("FRFR", window=4)
    base = ModuleExecutor.create(m, kv_dtype="float32").fingerprint()
    assert ModuleExecutor.create(m, kv_dtype="float32").fingerprint() == base
    assert ModuleExecutor.create(m, "batched-cell", kv_dtype="float32").fingerprint() != base
    assert ModuleExecutor.create(m, kv_dtype=mx.float16).fingerprint() != base
    assert ModuleExecutor.create(tiny_model("FRFR", window=5), kv_dtype="float32").fingerprint() != base
    assert ModuleExecutor.create(m, kv_dtype="float32", model_fingerprint="weights-a").fingerprint() != base


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_is_seeded_per_session_and_leaves_greedy_neighbours_alone(model, kind) -> None:
    def run(seed: int) -> tuple[list[int], list[int]]:
        ex = make(model, kind)
        s, g = ex.open_session(), ex.open_session()
        ex.set_sampling(s, SamplingParams(temperature=1.5), seed)
        ex.set_sampling(g, SamplingParams(), seed)
        outs = ex.execute([ExecInput(s, 0, tokens=tuple(PROMPT)), ExecInput(g, 0, tokens=tuple(PROMPT))])
        ts, tg = [outs[0].tokens[0]], [outs[1].tokens[0]]
        for _ in range(11):
            o = ex.execute(
                [
                    ExecInput(s, ex.position(s), tokens=(ts[-1],)),
                    ExecInput(g, ex.position(g), tokens=(tg[-1],)),
                ]
            )
            ts.append(o[0].tokens[0])
            tg.append(o[1].tokens[0])
        return ts, tg

    s1, g1 = run(7)
    s2, g2 = run(7)
    s3, _ = run(8)
    assert s1 == s2 and s1 != s3
    assert g1 == g2 == reference_greedy(model, PROMPT, 12)[0]
    assert s1 != g1
