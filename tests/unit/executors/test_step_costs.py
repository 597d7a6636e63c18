"""StepCosts: the fixed / per-row cost ratio fitted from step intervals, and the draft decisions that
use it (``PromptLookupExecutor``)."""

from __future__ import annotations

import math
import random

import pytest

from engine_service.executors.base import ExecInput
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.step_costs import PRIOR_RATIO, StepCosts
from tests.unit.executors.helpers import greedy_decode, prefill
from tests.unit.executors.test_prompt_lookup import PROMPT, AlwaysDrafts, make


def fed(fixed: float, per_row: float, rows: list[int], noise: float = 0.0, seed: int = 0) -> StepCosts:
    costs, rng = StepCosts(), random.Random(seed)
    for r in rows:
        costs.observe(r, (fixed + r * per_row) * (1 + rng.uniform(-noise, noise)))
    return costs


@pytest.mark.parametrize(("fixed", "per_row"), [(0.008, 0.002), (0.0055, 0.0025), (0.004, 0.004)])
def test_the_ratio_of_a_linear_cost_is_recovered(fixed, per_row) -> None:
    rows = [8 + (i * 5) % 9 for i in range(200)]  # 8..16 rows, as drafts beside 8 sessions vary them
    assert fed(fixed, per_row, rows).ratio == pytest.approx(fixed / per_row, rel=1e-6)
    for seed in range(5):  # +-5% noise on each interval, extrapolated from 8..16 rows to 0
        assert fed(fixed, per_row, rows, noise=0.05, seed=seed).ratio == pytest.approx(
            fixed / per_row, rel=0.3
        )


def test_without_spread_in_rows_the_prior_holds_then_the_last_fit_does() -> None:
    costs = fed(0.006, 0.003, [8] * 100)  # one row count: no slope to fit (negative control)
    assert costs.ratio == PRIOR_RATIO and costs.observed == 100
    for i in range(60):
        costs.observe(8 + i % 5, 0.006 + (8 + i % 5) * 0.003)
    assert costs.ratio == pytest.approx(2.0, rel=0.05)
    for _ in range(200):  # the spread decays away: the fit stays
        costs.observe(8, 0.006 + 8 * 0.003)
    assert costs.ratio == pytest.approx(2.0, rel=0.05)


def test_a_pause_between_steps_is_not_a_step() -> None:
    rows = [1 + i % 4 for i in range(40)]
    costs = fed(0.008, 0.002, rows)
    costs.observe(2, 5.0)  # the engine thread idle between two decode batches
    assert costs.ratio == pytest.approx(4.0, rel=1e-6) and costs.observed == 40
    costs.observe(2, 0.024)  # a slow step (2x), not a pause: it counts
    assert costs.observed == 41 and costs.ratio != pytest.approx(4.0, rel=1e-6)


def test_bad_observations_are_ignored_and_the_prior_is_checked() -> None:
    costs = StepCosts()
    costs.observe(0, 0.01)
    costs.observe(3, 0.0)
    assert costs.observed == 0
    with pytest.raises(Exception, match="prior"):
        StepCosts(prior=math.nan)


@pytest.mark.parametrize(("ratio", "kept"), [(1.0, False), (16.0, True)])
def test_the_draft_decision_follows_the_costs_ratio(tiny_model, ratio, kept) -> None:
    """Three sessions at acceptance 0.45 each drafting 2: beside 3 decode rows they pay when a forward's
    fixed cost is 16 rows (0.45 x 6 x 19 > 1.05 x 3 x 7) and not when it is one row (each session's own
    bar, 3 / 4, is above 0.45: no draft is even looked up). The output equals plain greedy's either way."""
    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    spec = make(AlwaysDrafts, model, "batched-sequence", num_drafts=4, max_draft_rows=12,
                step_costs=StepCosts(prior=ratio))  # fmt: skip
    plain = make(ModuleExecutor, model, "batched-sequence")
    sids = [spec.open_session() for _ in range(3)]
    pending = [prefill(spec, s, PROMPT)[-1] for s in sids]
    for s in sids:
        spec._sessions.get(s).drafts.rate = 0.45
    want = greedy_decode(plain, (p := plain.open_session()), prefill(plain, p, PROMPT), 6)
    outs = spec.execute(
        [ExecInput(s, spec.position(s), tokens=(t,)) for s, t in zip(sids, pending, strict=True)]
    )
    assert (spec.drafted, spec.declined) == ((6, 0) if kept else (0, 0))
    assert all([t, *out.tokens] == want[: 1 + len(out.tokens)] for t, out in zip(pending, outs, strict=True))


def test_the_executor_times_decode_only_batches_back_to_back(tiny_model) -> None:
    """Prefill batches are not timed and break the chain; each decode batch after a decode batch is."""
    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    spec = make(AlwaysDrafts, model, "batched-sequence", num_drafts=2)
    s = spec.open_session()
    toks = list(prefill(spec, s, PROMPT))
    assert spec.step_costs.observed == 0
    for _ in range(3):
        toks.extend(spec.execute([ExecInput(s, spec.position(s), tokens=(toks[-1],))])[0].tokens)
    assert spec.step_costs.observed == 2
    other = spec.open_session()
    prefill(spec, other, PROMPT)  # a prefill batch: the next decode batch starts a new chain
    spec.execute([ExecInput(s, spec.position(s), tokens=(toks[-1],))])
    assert spec.step_costs.observed == 2
