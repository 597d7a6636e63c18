"""Prefill scheduling: shortest remaining prompt first, a bound on how long a prompt can be passed over,
and a short forward where a short prompt ends (``shared_batch_tokens``).

Each check runs against a control that must fail it: start order instead of the shortest first, a
starvation bound too large to act, ``shared_batch_tokens=0``.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine_service.api.config import GenConfig
from engine_service.runtime import engine_loop, scheduler
from engine_service.runtime.scheduler import plan_batch
from engine_service.runtime.state import ActiveGeneration, SessionRecord
from tests.unit.runtime.conftest import VOCAB, engine_paused
from tests.unit.runtime.fake_executor import FakeExecutor


def prefilling(key: int, size: int, admitted: int = 0) -> ActiveGeneration:
    """A generation with ``size`` prompt positions still to feed, admitted at step ``admitted``."""
    gen = ActiveGeneration(handle=None, config=GenConfig(), callback=None, input=(5,) * size)
    gen.record = SessionRecord(key=key, sid=100 + key, position=0)
    gen.segments, gen.last_step = [gen.input], admitted
    return gen


def fed(plan, gen: ActiveGeneration) -> int:
    return sum(p.input.size() for p in plan.inputs if p.gen is gen)


@pytest.mark.parametrize("shortest_first", [True, False], ids=["shortest-first", "start-order-control"])
def test_the_shortest_remaining_prompt_is_fed_first(monkeypatch, shortest_first):
    if not shortest_first:  # the planner as it was: prompts in start order
        monkeypatch.setattr(scheduler, "sorted", lambda items, key=None: list(items), raising=False)
    long, short = prefilling(0, 300), prefilling(1, 40)
    plan = plan_batch([long, short], max_decode=8, preferred_tokens=40, step=1)
    if shortest_first:
        assert fed(plan, short) == 40 and fed(plan, long) == 0
        assert plan.inputs[0].input.want_output, "the short prompt's last chunk asks for its logits"
    else:
        assert fed(plan, long) == 40 and fed(plan, short) == 0


def test_prefill_left_counts_every_segment_past_the_cursor():
    gen = prefilling(0, 10)
    gen.segments = [(7,), gen.input]  # a pending token replayed before the input
    assert gen.prefill_left() == 11
    gen.take_chunk(1)
    gen.take_chunk(4)
    assert gen.prefill_left() == 6


@pytest.mark.parametrize("bound", [scheduler.STARVED_STEPS, 10**9], ids=["bounded", "unbounded-control"])
def test_a_long_prompt_is_not_held_back_by_a_stream_of_short_ones(monkeypatch, bound):
    monkeypatch.setattr(scheduler, "STARVED_STEPS", bound)
    long = prefilling(0, 10_000)
    fed_steps = []
    for step in range(1, 60):
        short = prefilling(step, 30, admitted=step)  # a new short prompt every forward, fed whole
        plan = plan_batch([long, short], max_decode=8, preferred_tokens=30, step=step)
        if fed(plan, long):
            fed_steps.append(step)
    gaps = [b - a for a, b in zip([0, *fed_steps], [*fed_steps, 60], strict=False)]
    if bound == scheduler.STARVED_STEPS:
        assert max(gaps) <= bound + 1
    else:
        assert not fed_steps, "the control never starved the long prompt"


def forwards(fake: FakeExecutor, sids: set[int]) -> list[int]:
    """Positions of each forward that fed any of ``sids``."""
    with fake.lock:
        return [sum(i.size() for i in batch) for batch in fake.batches if {i.sid for i in batch} & sids]


@pytest.mark.parametrize("shared", [48, 0], ids=["shared-48", "off-control"])
def test_a_forward_that_ends_a_short_prompt_stays_short(shared):
    long, short = prefilling(0, 300), prefilling(1, 30)
    plan = plan_batch([long, short], max_decode=8, preferred_tokens=256, step=1, short_tokens=shared)
    assert fed(plan, short) == 30 and plan.inputs[0].gen is short
    if shared:
        assert fed(plan, long) == shared - 30, "the long prompt fills the short forward's room"
    else:
        assert fed(plan, long) == 256 - 30, "the control's forward was short anyway"


def test_long_prompts_alone_keep_the_full_budget():
    a, b = prefilling(0, 300), prefilling(1, 200)
    plan = plan_batch([a, b], max_decode=8, preferred_tokens=256, step=1, short_tokens=48)
    assert fed(plan, b) == 200 and fed(plan, a) == 56  # the shorter first, the forward 256 long


@pytest.mark.parametrize("shared", [48, 0], ids=["shared-48", "off-control"])
def test_through_a_runner_a_short_prompt_beside_a_long_one(make_runner, shared):
    fake = FakeExecutor(vocab_size=VOCAB, max_session_tokens=1024, preferred_batch_tokens=256)
    runner = make_runner(fake, shared_batch_tokens=shared)
    a, b = runner.open_session(), runner.open_session()
    with engine_paused(runner, fake):
        handles = [a.generate_async([3] * 600, GenConfig(max_new_tokens=1))]
        handles.append(b.generate_async([4] * 20, GenConfig(max_new_tokens=1)))
    assert all(h.wait(10).finish_reason == "length" for h in handles)
    sizes = forwards(fake, {a._record.sid, b._record.sid})
    assert sizes[0] == (shared if shared else 256), sizes  # the short prompt's forward
    assert max(sizes) == 256, "the long prompt alone runs full forwards"
    for s in (a, b):
        s.close()


def test_shared_batch_tokens_is_validated(make_runner):
    from engine_service.api.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="shared_batch_tokens"):
        make_runner(shared_batch_tokens=-1)


def test_the_engine_flag_reaches_the_settings_and_a_bad_value_names_it():
    from engine_service.__main__ import executor_settings, parse_args
    from engine_service.api.errors import InvalidArgument

    assert executor_settings(parse_args(["--shared_batch_tokens", "64"])).shared_batch_tokens == 64
    assert executor_settings(parse_args([])).shared_batch_tokens == 128
    with pytest.raises(InvalidArgument, match="shared_batch_tokens must be >= 0, got -2"):
        executor_settings(parse_args(["--shared_batch_tokens", "-2"]))


class SlowFake(FakeExecutor):
    """Each forward takes 0.2 s, as a long prefill chunk does on a CPU."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.entered_forward = threading.Event()

    def execute(self, batch):
        self.entered_forward.set()
        time.sleep(0.2)
        return super().execute(batch)


@pytest.mark.parametrize("linger", [1.0, 0.0], ids=["linger", "no-linger-control"])
def test_a_generate_right_after_its_clone_joins_the_next_forward(make_runner, monkeypatch, linger):
    """The prefix service clones, then starts a Generate on the clone: the engine waits for it
    (``LINGER_S``) before a long prefill's next forward instead of making it wait that whole forward."""
    monkeypatch.setattr(engine_loop, "LINGER_S", linger)
    fake = SlowFake(vocab_size=VOCAB, max_session_tokens=1024, preferred_batch_tokens=256)
    runner = make_runner(fake)
    stored, long = runner.open_session(), runner.open_session()
    stored.generate_async([2] * 10, GenConfig(max_new_tokens=1)).wait(10)
    fake.entered_forward.clear()
    cold = long.generate_async([3] * 600, GenConfig(max_new_tokens=1))
    assert fake.entered_forward.wait(10)  # its first 256 positions are being computed
    hit = stored.clone_async(10).result(10)  # answered between that forward and the next
    short = hit.generate_async([4] * 20, GenConfig(max_new_tokens=1))
    assert short.wait(10).finish_reason == "length" and cold.wait(10).finish_reason == "length"
    with fake.lock:
        fed = [{i.sid for i in batch} for batch in fake.batches if long._record.sid in {i.sid for i in batch}]
    assert (hit._record.sid in fed[1]) == bool(linger), fed
    for s in (stored, long, hit):
        s.close()
