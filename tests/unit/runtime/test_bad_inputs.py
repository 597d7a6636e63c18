"""Each bad input fails only its own generation; a healthy generation beside it matches a solo run."""

from __future__ import annotations

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.errors import FailedPrecondition, GenerationError, InvalidArgument
from tests.unit.runtime.conftest import VOCAB, engine_paused
from tests.unit.runtime.fake_executor import FakeExecutor, FakePrepared, OtherPrepared, reference

HEALTHY = [31, 32, 33, 34, 35, 36]
MAX_TOKENS = 64


def raising_callback(update):
    if update.tokens:
        raise ValueError("user callback exploded")


CASES = {
    "out_of_vocab": ([1, VOCAB, 2], None, InvalidArgument, "outside the vocabulary"),
    "negative_token": ([-1], None, InvalidArgument, "outside the vocabulary"),
    "empty": ([], None, InvalidArgument, "empty"),
    "too_long": ([1] * (MAX_TOKENS + 1), None, InvalidArgument, "max_session_tokens"),
    "unsupported_kind": (OtherPrepared([1, 2]), None, InvalidArgument, "other-prepared"),
    "callback_raises": ([3, 4, 5], raising_callback, GenerationError, "user callback exploded"),
    "executor_input_error": ([3, 4, 5], None, GenerationError, "fake input failure"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_alone(make_runner, case):
    bad_input, callback, error_type, message = CASES[case]
    fake = FakeExecutor(vocab_size=VOCAB, max_session_tokens=MAX_TOKENS)
    runner = make_runner(fake)
    healthy, bad = runner.open_session(), runner.open_session()
    if case == "executor_input_error":
        fake.error_for_sids.add(bad._record.sid)
    healthy_updates = []
    with engine_paused(runner, fake):  # both starts are drained together, then run side by side
        h = healthy.generate_async(
            HEALTHY, GenConfig(max_new_tokens=8, prefill_chunk=2, seed=5), healthy_updates.append
        )
        b = bad.generate_async(bad_input, GenConfig(max_new_tokens=8, prefill_chunk=2), callback)
    bad_result = b.wait(10)
    assert bad_result.finish_reason == "error"
    assert isinstance(b.error, error_type) and message in str(b.error) and message in bad_result.error
    good = h.wait(10)
    assert good.finish_reason == "length"
    assert good.tokens == tuple(reference(HEALTHY, 5, 8, VOCAB))
    assert [t for u in healthy_updates for t in u.tokens] == list(good.tokens)
    assert runner.running
    bad_sid = bad._record.sid
    ran_together = any({i.sid for i in batch} >= {bad_sid, healthy._record.sid} for batch in fake.batches)
    if case in ("callback_raises", "executor_input_error"):
        assert ran_together  # non-vacuous: the failing generation really shared forwards
    else:
        assert all(i.sid != bad_sid for batch in fake.batches for i in batch)  # rejected before any work
    if case == "executor_input_error":
        assert not bad.valid
        with pytest.raises(FailedPrecondition):
            bad.generate_async([1], GenConfig())
        return
    # The bad session is intact: the next generation continues exactly from what it committed.
    history = list(bad_input) + list(bad_result.tokens) if case == "callback_raises" else []
    cont = bad.generate_async([7, 8], GenConfig(max_new_tokens=3)).wait(10)
    assert cont.tokens == tuple(reference(history + [7, 8], 0, 3, VOCAB))


def test_failed_batch_poisons_its_sessions_and_engine_keeps_running(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake)
    a, b = runner.open_session(), runner.open_session()
    fake.raise_for_sids.add(a._record.sid)
    with engine_paused(runner, fake):
        ha = a.generate_async([1, 2], GenConfig(max_new_tokens=3))
        hb = b.generate_async([3, 4], GenConfig(max_new_tokens=3))
    assert ha.wait(10).finish_reason == "error" and hb.wait(10).finish_reason == "error"
    assert "fake batch failure" in str(ha.error)
    assert not a.valid and not b.valid
    assert a.clone_async(0).result(10) is None
    c = runner.open_session()
    assert c.generate_async([5], GenConfig(max_new_tokens=2)).wait(10).tokens == tuple(
        reference([5], 0, 2, VOCAB)
    )
    assert runner.metrics().failed_batches == 1


def test_prepared_input_of_an_accepted_kind_runs_beside_tokens(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake)
    s1, s2 = runner.open_session(), runner.open_session()
    prepared = FakePrepared([1, 2, 3])
    with engine_paused(runner, fake):
        h1 = s1.generate_async(prepared, GenConfig(max_new_tokens=4))
        h2 = s2.generate_async(HEALTHY, GenConfig(max_new_tokens=4))
    assert h1.wait(10).tokens == tuple(reference(prepared.history_values(), 0, 4, VOCAB))
    assert h2.wait(10).tokens == tuple(reference(HEALTHY, 0, 4, VOCAB))


@pytest.mark.parametrize("bad", [["a"], [1.5], [True], 7])
def test_non_integer_tokens_raise_invalid_argument(runner, bad):
    s = runner.open_session()
    with pytest.raises(InvalidArgument):
        s.generate_async(bad, GenConfig())
    assert s.generate_async([1], GenConfig(max_new_tokens=1)).wait(10).finish_reason == "length"
