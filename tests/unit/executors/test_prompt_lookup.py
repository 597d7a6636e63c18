"""PromptLookupExecutor: n-gram drafts, greedy verification equal to plain greedy, rewind of rejects."""

from __future__ import annotations

import math

import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.cache.config import CacheConfig
from engine_service.cache.registry import build_cache
from engine_service.executors.base import ExecInput
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.prompt_lookup import PromptLookupExecutor
from engine_service.executors.sampling import SamplingParams
from tests.unit.executors.helpers import CountingModel, greedy_decode, prefill

KINDS = ("batched-sequence", "batched-cell")
# a prompt that repeats itself, so n-gram lookups find drafts
PROMPT = [17, 4, 99, 23, 56, 8, 71, 30, 17, 4, 99, 23, 56, 8, 71, 30, 17, 4]


def make(cls, model, kind, **kw):
    kw.setdefault("prefill_chunk", 8)
    return cls.create(model, kind, max_sessions=4, max_session_tokens=256, **kw)


def test_lookup_takes_the_latest_longest_match(tiny_model) -> None:
    ex = make(PromptLookupExecutor, tiny_model(), "batched-sequence", num_drafts=3, ngram_min=1)
    assert ex.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == (
        7,
        8,
        5,
    )  # no trigram (5,2,3) match; latest bigram (2,3)
    assert ex.lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == (4, 5, 1)  # trigram match
    assert ex.lookup([1, 2, 3, 4, 5, 6], 3) == ()  # no match at all
    assert ex.lookup([5, 6, 5], 2) == (6, 5)  # unigram
    assert ex.lookup([7, 8, 9, 8], 1) == (9,)
    assert ex.lookup([4, -1, -1, 4], 3) == ()  # prepared positions are never drafted


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tie", [True, False])
def test_greedy_output_equals_plain_greedy(tiny_model, kind, tie) -> None:
    model = tiny_model("FRFR", window=4, tie_embeddings=tie)
    plain = make(ModuleExecutor, model, kind)
    spec_model = CountingModel(model)
    spec = make(PromptLookupExecutor, spec_model, kind, num_drafts=4)
    want = greedy_decode(plain, (p := plain.open_session()), prefill(plain, p, PROMPT), 40)
    s = spec.open_session()
    got = greedy_decode(spec, s, prefill(spec, s, PROMPT), 40)
    assert got == want
    assert spec.drafted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_accepts_and_rejects_both_happen_and_positions_are_exact(tiny_model, kind) -> None:
    totals = {"accepted": 0, "rejected": 0}
    for tie in (True, False):
        model = tiny_model("FRFR", window=4, tie_embeddings=tie)
        spec = make(PromptLookupExecutor, model, kind, num_drafts=4)
        s = spec.open_session()
        pending = prefill(spec, s, PROMPT)[-1]
        produced = 0
        while produced < 30:
            before = spec.position(s)
            accepted_before = spec.accepted
            out = spec.execute([ExecInput(s, before, tokens=(pending,))])[0]
            produced += len(out.tokens)
            # pending + accepted drafts are committed: position advances by len(tokens)
            assert spec.position(s) == before + len(out.tokens)
            assert len(out.tokens) == 1 + spec.accepted - accepted_before
            pending = out.tokens[-1]
        totals["accepted"] += spec.accepted
        totals["rejected"] += spec.drafted - spec.accepted
    assert totals["accepted"] > 0 and totals["rejected"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_clone_after_speculation_matches_plain(tiny_model, kind) -> None:
    model = tiny_model("FRFR", window=4, tie_embeddings=False)
    spec = make(PromptLookupExecutor, model, kind, num_drafts=4)
    s = spec.open_session()
    toks = greedy_decode(spec, s, prefill(spec, s, PROMPT), 12)
    at = spec.position(s)
    child = spec.clone(s, at)
    assert child is not None and spec.position(child) == at
    history = PROMPT + toks
    suffix = [40, 41]
    out = spec.execute([ExecInput(child, at, tokens=tuple(suffix))])[0]
    plain = make(ModuleExecutor, model, kind)
    p = plain.open_session()
    cold = prefill(plain, p, history[:at] + suffix)
    assert out.tokens[-1] == cold[-1]


def test_logprobs_of_the_accepted_tokens_equal_plain_decoding(tiny_model) -> None:
    """A session asking for log probabilities drafts too: each returned token's entry is its own row's
    (the rejected rows' entries are dropped), equal to plain decoding's."""
    model = tiny_model("FFFF", window=4, tie_embeddings=False)

    def run(cls, **kw):
        ex = make(cls, model, "batched-sequence", **kw)
        s = ex.open_session()
        ex.set_sampling(s, SamplingParams(temperature=0.0, top_logprobs=2), 3)
        toks, entries = list(prefill(ex, s, PROMPT)), []
        while len(toks) < 40:
            out = ex.execute([ExecInput(s, ex.position(s), tokens=(toks[-1],))])[0]
            toks.extend(out.tokens)
            entries.extend(out.logprobs)
        return ex, toks, entries

    _, want, want_entries = run(ModuleExecutor)
    spec, got, got_entries = run(PromptLookupExecutor, num_drafts=4)
    assert got == want and spec.accepted > 0
    assert [e.chosen.id for e in got_entries] == got[1 : 1 + len(got_entries)]
    n = min(len(got_entries), len(want_entries))
    assert (
        max(
            abs(a.chosen.logprob - b.chosen.logprob)
            for a, b in zip(got_entries[:n], want_entries[:n], strict=True)
        )
        < 1e-3
    )


def test_drafts_must_fit_max_write(tiny_model) -> None:
    with pytest.raises(InvalidArgument, match="max_write"):
        make(PromptLookupExecutor, tiny_model(), "batched-sequence", prefill_chunk=4, num_drafts=4)
    with pytest.raises(InvalidArgument, match="num_drafts"):
        make(PromptLookupExecutor, tiny_model(), "batched-sequence", num_drafts=0)


def test_drafts_are_dropped_when_the_cache_has_no_room(tiny_model) -> None:
    model = tiny_model()

    def executor(capacity: int) -> PromptLookupExecutor:
        cfg = model.config
        cache = build_cache(
            "batched-sequence",
            CacheConfig(
                capacity=capacity,
                max_seqs=4,
                layers=cfg.layers,
                kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                max_write=8,
            ),
        )
        return PromptLookupExecutor(
            model,
            cache,
            cache_kind="batched-sequence",
            max_sessions=4,
            max_session_tokens=128,
            max_write=8,
            num_drafts=4,
            ngram_min=1,
        )

    for capacity, room in ((37, False), (200, True)):  # 2 x 18 rows leave room for the pending row only
        spec = executor(capacity)
        s = spec.open_session()
        pending = prefill(spec, s, PROMPT)[-1]
        prefill(spec, spec.open_session(), PROMPT)  # a second session's own 18 rows (a clone would share)
        out = spec.execute([ExecInput(s, spec.position(s), tokens=(pending,))])[0]
        assert out.error is None and len(out.tokens) >= 1
        assert (spec.drafted > 0) == room


@pytest.mark.parametrize("kind", KINDS)
def test_rows_written_past_the_accepted_position_are_never_cloned(tiny_model, kind) -> None:
    model = tiny_model("FRFR", window=4, tie_embeddings=False)  # varied output: drafts get rejected
    spec = make(PromptLookupExecutor, model, kind, num_drafts=4)
    s = spec.open_session()
    pending = prefill(spec, s, PROMPT)[-1]
    history = list(PROMPT)
    while True:  # step until a step rejects drafts (its K/V went past the accepted position)
        before, drafted, accepted = spec.position(s), spec.drafted, spec.accepted
        out = spec.execute([ExecInput(s, before, tokens=(pending,))])[0]
        history += [pending, *out.tokens[:-1]]
        pending = out.tokens[-1]
        if spec.drafted - drafted > spec.accepted - accepted:
            break
    at = spec.position(s)
    assert at == before + len(out.tokens)
    assert spec.clone(s, at + 1) is None  # the rejected rows were written but are not committed
    child = spec.clone(s, at)
    assert child is not None and spec.position(child) == at
    plain = make(ModuleExecutor, model, kind)
    p = plain.open_session()
    assert len(history) == at
    got = spec.execute([ExecInput(child, at, tokens=(pending,))])[0].tokens[-1]
    assert got == prefill(plain, p, [*history, pending])[-1]


def _seeded(ex, temperature: float, seed: int, n: int = 40) -> list[int]:
    s = ex.open_session()
    ex.set_sampling(s, SamplingParams(temperature=temperature), seed)
    return greedy_decode(ex, s, prefill(ex, s, PROMPT), n)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.05, 0.1, 0.15])
def test_seeded_sampling_with_drafts_equals_plain_seeded_sampling(tiny_model, kind, temperature) -> None:
    """Each verification row is drawn with the key plain decoding uses at that draw: the same tokens,
    not just the same distribution; drafts were accepted and rejected (the check is not vacuous), and
    another seed gives another text (the negative control)."""
    model = tiny_model("FRFR", window=4, tie_embeddings=False)
    plain = make(ModuleExecutor, model, kind)
    spec = make(PromptLookupExecutor, model, kind, num_drafts=4)
    want = _seeded(plain, temperature, seed=11)
    assert _seeded(spec, temperature, seed=11) == want
    assert spec.accepted > 0 and spec.drafted > spec.accepted
    assert _seeded(plain, temperature, seed=12) != want


class WrongDrafts(PromptLookupExecutor):
    """Drafts that are wrong on purpose: the token after the one the lookup found."""

    def own_drafts(self, plan, budget, shortest=0):
        return tuple((t + 1) % self.config.vocab_size for t in super().own_drafts(plan, budget, shortest))


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_drafts_pause_and_the_lookahead_serves_the_session(tiny_model, kind) -> None:
    """Every draft rejected: the output is still plain greedy's, every clone continues like a cold
    run, the session stops drafting once drafts do not pay (the drafted count stalls for the pause)
    and the decode lookahead serves it meanwhile."""
    from engine_service.executors.prompt_lookup import PAUSE_STEPS

    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    plain = make(ModuleExecutor, model, kind)
    want = greedy_decode(plain, (p := plain.open_session()), prefill(plain, p, PROMPT), 60)
    spec = make(WrongDrafts, model, kind, num_drafts=4)
    s = spec.open_session()
    first = prefill(spec, s, PROMPT)
    drafted = []
    toks, at = list(first), len(PROMPT)  # positions tracked here: asking the executor settles a lookahead
    while len(toks) < 60:
        out = spec.execute([ExecInput(s, at, tokens=(toks[-1],))])[0]
        toks.extend(out.tokens)
        at += len(out.tokens)
        drafted.append(spec.drafted)
    assert toks[:60] == want[: len(toks[:60])]
    assert spec.drafted > 0 and spec.accepted == 0
    stalls = max(sum(1 for _ in g) for _, g in __import__("itertools").groupby(drafted))
    assert stalls >= PAUSE_STEPS and spec.lookahead_used > 0
    assert spec.position(s) == at
    child = spec.clone(s, at)
    out = spec.execute([ExecInput(child, at, tokens=(toks[at - len(PROMPT)],))])[0]
    q = plain.open_session()
    cold = prefill(plain, q, [*PROMPT, *toks][: at + 1])
    assert out.tokens[-1] == cold[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_suffix_drafts_come_from_the_same_owners_earlier_answer_only(tiny_model, kind) -> None:
    """``suffix``: an owner asking again drafts the earlier answer (accepted: the same tokens as plain
    greedy); another owner asking the same gets no suffix drafts (the negative control)."""
    model = tiny_model("FRFR", window=4, tie_embeddings=False)
    plain = make(ModuleExecutor, model, kind)
    spec = make(PromptLookupExecutor, model, kind, num_drafts=4, suffix=True)
    prompt = list(range(30, 60))  # no n-gram repeats: the first drafts can only come from elsewhere
    want = greedy_decode(plain, (p := plain.open_session()), prefill(plain, p, prompt), 30)

    def ask(owner: str) -> list[int]:
        s = spec.open_session()
        spec.set_sampling(s, SamplingParams(scope=owner), 0)
        got = greedy_decode(spec, s, prefill(spec, s, prompt), 30)
        spec.close_session(s)
        return got

    assert ask("alice") == want and spec.sources["suffix"] == [0, 0]
    assert ask("alice") == want and spec.sources["suffix"][1] > 0
    before = list(spec.sources["suffix"])
    assert ask("bob") == want and spec.sources["suffix"] == before


class AlwaysDrafts(PromptLookupExecutor):
    """Drafts its whole budget every step (wrong tokens, mostly)."""

    def own_drafts(self, plan, budget, shortest=0):
        return tuple(range(1, budget + 1))


def test_one_forward_verifies_at_most_max_draft_rows(tiny_model) -> None:
    """Three sessions that each draft 4: one batch verifies at most ``max_draft_rows`` drafts, in batch
    order (the first session's 4, the second's 1, none for the third); the output still equals plain
    greedy's."""
    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    spec = make(AlwaysDrafts, model, "batched-sequence", num_drafts=4, max_draft_rows=5)
    plain = make(ModuleExecutor, model, "batched-sequence")
    sids = [spec.open_session() for _ in range(3)]
    pending = [prefill(spec, s, PROMPT)[-1] for s in sids]
    want = greedy_decode(plain, (p := plain.open_session()), prefill(plain, p, PROMPT), 6)
    batch = [ExecInput(s, spec.position(s), tokens=(t,)) for s, t in zip(sids, pending, strict=True)]
    outs = spec.execute(batch)
    assert spec.drafted == 5
    assert all([t, *out.tokens] == want[: 1 + len(out.tokens)] for t, out in zip(pending, outs, strict=True))


@pytest.mark.parametrize("seed", range(20))
def test_the_incremental_index_drafts_what_the_scan_drafts(tiny_model, seed) -> None:
    """HistoryGrams, grown token by token and cut back now and then (as rewinds cut a history), finds
    the same drafts as ``lookup``'s scan of the whole context (the reference)."""
    import random

    from engine_service.executors.history_grams import HistoryGrams

    ex = make(PromptLookupExecutor, tiny_model(), "batched-sequence", num_drafts=3, ngram_min=1)
    rng = random.Random(seed)
    grams, history = HistoryGrams(1, 3), []
    for _ in range(300):
        if history and rng.random() < 0.05:
            del history[rng.randrange(len(history)) :]
            grams.cut(len(history))
        pending = rng.choice([1, 2, 3, 4, -1]) if rng.random() < 0.02 else rng.randrange(1, 6)
        budget = rng.randrange(1, 5)
        want = ex.lookup([*history, pending], budget)
        assert grams.find(history, len(history), pending, budget) == want
        history.append(pending)


@pytest.mark.parametrize(("rate", "kept"), [(0.45, False), (0.9, True)])
def test_a_batchs_drafts_are_taken_back_when_together_they_do_not_pay(tiny_model, rate, kept) -> None:
    """Three decoding sessions each drafting ceil(4 x rate) at ``rate`` (each above its own bar,
    3 / (4 + 3)): the batch verifies its D drafts only where rate x D x (4 + 3) > 1.05 x 3 x (1 + D) --
    0.45 (D = 6) does not, 0.9 (D = 12) does (the control). Either way the output equals plain greedy's."""
    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    spec = make(AlwaysDrafts, model, "batched-sequence", num_drafts=4, max_draft_rows=12)
    plain = make(ModuleExecutor, model, "batched-sequence")
    sids = [spec.open_session() for _ in range(3)]
    pending = [prefill(spec, s, PROMPT)[-1] for s in sids]
    for s in sids:
        spec._sessions.get(s).drafts.rate = rate
    want = greedy_decode(plain, (p := plain.open_session()), prefill(plain, p, PROMPT), 6)
    batch = [ExecInput(s, spec.position(s), tokens=(t,)) for s, t in zip(sids, pending, strict=True)]
    outs = spec.execute(batch)
    drafts = 3 * math.ceil(4 * rate)  # each session's budget: num_drafts x its rate
    assert (spec.drafted, spec.declined) == ((drafts, 0) if kept else (0, drafts))
    assert all([t, *out.tokens] == want[: 1 + len(out.tokens)] for t, out in zip(pending, outs, strict=True))
    assert all(spec.position(s) == len(PROMPT) + len(out.tokens) for s, out in zip(sids, outs, strict=True))


@pytest.mark.parametrize(("rate", "gives_up"), [(0.25, False), (0.9, True)])
def test_a_lookahead_step_gives_the_lookahead_up_only_for_drafts_that_pay(tiny_model, rate, gives_up) -> None:
    """On a lookahead step a lookup that finds drafts marks the session ``active`` (its next step runs
    without a lookahead, to verify them) only where they would pay beside the batch: one session with
    ceil(4 x rate) drafts needs rate x D x 5 > 1.05 x (1 + D). Either way its first draft is checked
    against the token drawn: the rate moves without a verification row."""
    from engine_service.executors.plan import Plan
    from engine_service.executors.prompt_lookup import RATE_WEIGHT

    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    spec = make(AlwaysDrafts, model, "batched-sequence", num_drafts=4)
    s = spec.open_session()
    pending = prefill(spec, s, PROMPT)[-1]
    state = spec._sessions.get(s)
    state.drafts.rate = rate
    spec._decoding = 1  # what execute sets for a batch of one decoding session
    plan = Plan(0, s, state, len(PROMPT), (pending,), True)
    spec._note_drafts(plan)
    assert state.drafts.active is gives_up and state.drafts.unverified == 1  # AlwaysDrafts: 1, 2, ...
    assert plan.drafts == ()  # a lookahead step verifies nothing
    spec._finish(plan, [7])  # the token drawn was not the draft
    assert state.drafts.unverified == -1
    assert state.drafts.rate == pytest.approx((1 - RATE_WEIGHT) * rate) or state.drafts.paused > 0
