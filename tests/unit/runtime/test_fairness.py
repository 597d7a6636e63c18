"""Decode fairness: with more decoding sessions than ``max_decode_sequences``, none is starved.

Every decoding generation must advance at least once every ``ceil(n / max_decode)`` steps (the
planner takes the least recently stepped first). Each check also runs against a deliberately unfair
planner, the same ``plan_batch`` with its decode sort key made constant (``sorted`` without a key
keeps the live order, so the first ``max_decode`` generations always win): the check must see the
starvation, or it could not fail.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import pytest

from engine_service.api.config import GenConfig
from engine_service.runtime import scheduler
from engine_service.runtime.scheduler import plan_batch
from engine_service.runtime.state import ActiveGeneration, SessionRecord
from tests.unit.runtime.conftest import VOCAB, engine_paused
from tests.unit.runtime.fake_executor import FakeExecutor


def longest_wait(rounds: Sequence[Collection[object]], member: object, end: int) -> int:
    """Most rounds ``member`` waits to advance: from before round 0, between its rounds, and up to ``end``."""
    served = [-1] + [i for i, advanced in enumerate(rounds[:end]) if member in advanced] + [end]
    return max(b - a for a, b in zip(served, served[1:], strict=False))


def make_unfair(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the planner's decode sort key constant: the first ``max_decode`` decoders always win."""
    monkeypatch.setattr(scheduler, "sorted", lambda items, key=None: list(items), raising=False)


def decoding(key: int) -> ActiveGeneration:
    """A generation past its prompt, with a pending token to feed."""
    gen = ActiveGeneration(handle=None, config=GenConfig(), callback=None, input=(1,))
    gen.record = SessionRecord(key=key, sid=100 + key, position=4, pending=7)
    return gen


def test_longest_wait_counts_gaps_and_the_tail():
    rounds = [{"a"}, {"b"}, {"a"}, set(), set()]
    assert longest_wait(rounds, "a", len(rounds)) == 3  # round 2 -> the end (5)
    assert longest_wait(rounds, "b", len(rounds)) == 4
    assert longest_wait(rounds, "c", len(rounds)) == 6  # never served
    assert longest_wait(rounds, "a", 3) == 2


@pytest.mark.parametrize(("fair"), [True, False], ids=["fair", "constant-key-control"])
@pytest.mark.parametrize(("n", "max_decode"), [(5, 2), (7, 3), (4, 1), (9, 4)])
def test_plan_batch_steps_every_decoder_within_a_bound(monkeypatch, n, max_decode, fair):
    if not fair:
        make_unfair(monkeypatch)
    gens = [decoding(i) for i in range(n)]
    rounds = []
    for step in range(4 * n):
        plan = plan_batch(gens, max_decode, preferred_tokens=64, step=step)
        assert all(p.decode for p in plan.inputs) and len(plan.inputs) == max_decode
        assert len({id(p.gen) for p in plan.inputs}) == max_decode, "a generation planned twice"
        rounds.append({id(p.gen) for p in plan.inputs})
    worst = max(longest_wait(rounds, id(g), len(rounds)) for g in gens)
    bound = math.ceil(n / max_decode)
    if fair:
        assert worst <= bound
    else:
        assert worst > bound, "the check did not see a starving planner"


@pytest.mark.parametrize(("fair"), [True, False], ids=["fair", "constant-key-control"])
def test_every_decoding_session_advances_through_a_runner(make_runner, monkeypatch, fair):
    n, max_decode, new_tokens = 5, 2, 10
    if not fair:
        make_unfair(monkeypatch)
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake, max_decode_sequences=max_decode)
    sessions = [runner.open_session() for _ in range(n)]
    with engine_paused(runner, fake):  # every start is drained before the next forward: one prefill
        handles = [
            s.generate_async([3 + i], GenConfig(max_new_tokens=new_tokens)) for i, s in enumerate(sessions)
        ]
    results = [h.wait(10) for h in handles]
    assert all(r.finish_reason == "length" and len(r.tokens) == new_tokens for r in results)
    sids = [s._record.sid for s in sessions]
    with fake.lock:
        rounds = [{inp.sid for inp in batch} & set(sids) for batch in fake.batches]
    rounds = rounds[next(i for i, r in enumerate(rounds) if r) :]  # from the batch that prefills them
    assert rounds[0] == set(sids), "the prompts were not prefilled together"
    assert all(len(r) <= max_decode for r in rounds[1:])
    # A generation ends on its last batch: count its waits up to there.
    worst = max(longest_wait(rounds, sid, max(i for i, r in enumerate(rounds) if sid in r)) for sid in sids)
    bound = math.ceil(n / max_decode)
    if fair:
        assert worst <= bound
    else:
        assert worst >= new_tokens - 1 > bound, "the check did not see a starving planner"
    for s in sessions:
        s.close()
