"""What a session holds, as the engine records it (``SessionRecord.content``), and clones that check it.

The independent truth is the fake executor's own history of each sequence (what it actually wrote at
the committed positions) and, for the real speculative executor, the prompt plus the tokens a
generation returned. Every check goes through the public ``Session.content_digest`` /
``clone_async(upto, expected_digest)``.
"""

from __future__ import annotations

import hashlib
import struct
from array import array

import pytest

from engine_service.api.answers import CloneRefusal
from engine_service.api.config import GenConfig
from engine_service.api.content import PREPARED, check_digest, content_digest
from engine_service.api.errors import InvalidArgument
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.prompt_lookup import PromptLookupExecutor
from engine_service.runtime.content_log import ContentLog
from engine_service.runtime.runner import Runner
from tests.unit.runtime.conftest import VOCAB, Recorder
from tests.unit.runtime.fake_executor import FakeExecutor, FakePrepared, reference

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def history(fake: FakeExecutor, session) -> list[int]:
    """What the fake executor wrote for ``session`` at its committed positions."""
    return fake.seqs[session._record.sid].history[: session.position]


def other(tokens: list[int], at: int) -> list[int]:
    """``tokens`` with the id at ``at`` changed (same length)."""
    return tokens[:at] + [(tokens[at] + 1) % VOCAB] + tokens[at + 1 :]


# -- the digest ---------------------------------------------------------------------------------


def test_digest_is_blake2b_of_little_endian_int32_ids() -> None:
    ids = [0, 1, 127, 2**31 - 1]
    want = hashlib.blake2b(struct.pack("<4i", *ids), digest_size=16, person=b"forkline-cont-v1").digest()
    assert content_digest(ids) == content_digest(tuple(ids)) == content_digest(array("i", ids)) == want
    assert len(content_digest([])) == 16 and content_digest([1, 2]) != content_digest([2, 1])
    with pytest.raises(InvalidArgument, match="int32"):
        content_digest([2**31])
    assert check_digest(b"", "d") is None and check_digest(want, "d") == want
    with pytest.raises(InvalidArgument, match="expected_content_digest must be empty or 16 bytes, got 3"):
        check_digest(b"abc", "expected_content_digest")


def test_content_log_rewinds_copies_and_has_no_digest_over_a_prepared_input() -> None:
    log = ContentLog()
    log.commit(0, (1, 2, 3), 3)
    log.commit(3, None, 2)
    log.extend((7,))
    assert log.values() == (1, 2, 3, PREPARED, PREPARED, 7)
    assert log.digest(3) == content_digest([1, 2, 3]) and log.digest() is None and log.digest(4) is None
    log.commit(2, (9,), 1)  # a rewind
    assert log.values() == (1, 2, 9) and log.digest() == content_digest([1, 2, 9])
    child = log.prefix(2)
    log.extend((5,))
    assert child.values() == (1, 2) and len(log) == 4
    for bad in (-1, 5):
        with pytest.raises(InvalidArgument, match="outside"):
            log.digest(bad)


# -- what the runner records --------------------------------------------------------------------


def test_content_follows_chunked_prefill_decode_and_a_continuation(runner, fake) -> None:
    s = runner.open_session()
    seen: list[bool] = []
    recorder = Recorder(
        runner,
        then=lambda u: seen.append(
            s.content_digest() == content_digest(history(fake, s)) and s.position == u.position
        ),
    )
    first = s.generate_async(PROMPT, GenConfig(max_new_tokens=6, prefill_chunk=3), recorder).wait(10)
    assert len(recorder.updates) > 6 and all(seen)  # every prefill chunk and decode step
    assert s.content_digest() == content_digest(PROMPT + list(first.tokens[:-1]))
    # the next generation feeds the pending token first, then its input
    more = s.generate_async([5, 6], GenConfig(max_new_tokens=3)).wait(10)
    whole = PROMPT + list(first.tokens) + [5, 6] + list(more.tokens[:-1])
    assert s.content_digest() == content_digest(whole) == content_digest(history(fake, s))
    assert s.content_digest(4) == content_digest(PROMPT[:4])


def test_speculative_drafts_are_content_and_a_cut_rewinds_it(make_runner) -> None:
    fake = FakeExecutor(vocab_size=VOCAB, speculative=True)
    runner = make_runner(fake)
    s = runner.open_session()
    out = s.generate_async(PROMPT, GenConfig(max_new_tokens=7)).wait(10)
    assert (
        s.content_digest()
        == content_digest(PROMPT + list(out.tokens[:-1]))
        == content_digest(history(fake, s))
    )
    # max_new_tokens=1 cuts the accepted draft: it becomes pending, the committed position falls back
    t = runner.open_session()
    cut = t.generate_async(PROMPT, GenConfig(max_new_tokens=1)).wait(10)
    assert t.position == len(PROMPT) and len(fake.seqs[t._record.sid].history) == len(PROMPT) + 1
    assert t.content_digest() == content_digest(PROMPT)
    again = t.generate_async([3], GenConfig(max_new_tokens=2)).wait(10)  # starts below the executor's length
    whole = PROMPT + list(cut.tokens) + [3] + list(again.tokens[:-1])
    assert t.content_digest() == content_digest(whole) == content_digest(history(fake, t))


def test_prompt_lookup_speculation_records_exactly_the_committed_tokens(tiny_model) -> None:
    repetitive = [17, 4, 99, 23, 56, 8, 71, 30] * 3
    executor = PromptLookupExecutor.create(
        tiny_model("FFFF"), "batched-sequence", 4, 256, prefill_chunk=8, num_drafts=4
    )  # full layers: every position can be cloned
    runner = Runner(executor)
    try:
        with runner.open_session() as s:
            out = s.generate_async(repetitive, GenConfig(max_new_tokens=24)).wait(60)
            committed = repetitive + list(out.tokens[:-1])
            assert executor.accepted > 0 and s.position == len(committed)
            assert s.content_digest() == content_digest(committed)
            for upto in (0, len(repetitive), len(committed)):
                child = s.clone_async(upto, content_digest(committed[:upto])).result(30)
                assert child is not None and child.content_digest() == content_digest(committed[:upto])
                child.close()
    finally:
        runner.shutdown()


def test_clone_at_every_position_checks_the_expected_content(runner, fake) -> None:
    s = runner.open_session()
    out = s.generate_async(PROMPT, GenConfig(max_new_tokens=3)).wait(10)
    committed = PROMPT + list(out.tokens[:-1])
    for upto in range(len(committed) + 1):
        child = s.clone_async(upto, content_digest(committed[:upto])).result(10)
        assert child is not None and child.position == upto
        assert (
            child.content_digest() == content_digest(committed[:upto]) == content_digest(history(fake, child))
        )
        child.close()
        if upto:
            wrong = s.clone_async(upto, content_digest(other(committed, upto - 1)[:upto]))
            assert wrong.result(10) is None and wrong.refusal is CloneRefusal.CONTENT_MISMATCH
    # refusals asked the executor nothing and changed nothing: the source continues like a cold run
    assert len(fake.calls_named("clone")) == len(committed) + 1
    assert s.content_digest() == content_digest(committed)
    more = s.generate_async([5], GenConfig(max_new_tokens=4)).wait(10)
    assert list(more.tokens) == reference(committed + [out.tokens[-1], 5], 0, 4, VOCAB)


def test_a_prepared_input_is_content_without_a_token_digest(runner) -> None:
    s = runner.open_session()
    first = s.generate_async([1, 2, 3], GenConfig(max_new_tokens=1)).wait(10)
    s.generate_async(FakePrepared((5, 6, 7)), GenConfig(max_new_tokens=1)).wait(10)
    tokens = [1, 2, 3, first.tokens[-1]]
    assert s.position == 7 and s.content_digest() is None and s.content_digest(6) is None
    assert s.content_digest(4) == content_digest(tokens)
    assert s.clone_async(4, content_digest(tokens)).result(10) is not None
    guess = s.clone_async(7, content_digest(tokens + [PREPARED] * 3))
    assert guess.result(10) is None and guess.refusal is CloneRefusal.PREPARED_INPUT
    plain = s.clone_async(6).result(10)  # a clone without an expected digest is unchanged
    assert plain is not None and plain.content_digest() is None


def test_clone_refusals_say_why(make_runner) -> None:
    fake = FakeExecutor(vocab_size=VOCAB)
    runner = make_runner(fake)
    s = runner.open_session()
    s.generate_async(PROMPT, GenConfig(max_new_tokens=2)).wait(10)
    for upto in (-1, len(PROMPT) + 2):
        future = s.clone_async(upto)
        assert future.result(10) is None and future.refusal is CloneRefusal.POSITION
    fake.refuse_clone = True
    future = s.clone_async(3)
    assert future.result(10) is None and future.refusal is CloneRefusal.BOUNDARY
    with pytest.raises(InvalidArgument, match="expected_digest must be 16 bytes"):
        s.clone_async(3, b"short")
    s.close()
    assert s.clone_async(3).refusal is CloneRefusal.SOURCE_UNUSABLE
    runner.shutdown()
    t_future = runner._clone(0, 0)
    assert t_future.result() is None and t_future.refusal is CloneRefusal.STOPPING


def test_module_executor_session_content_equals_its_input(tiny_model) -> None:
    """The same record over the real executor (no speculation): chunked prefill then decode."""
    executor = ModuleExecutor.create(tiny_model(), "batched-cell", 2, 128, prefill_chunk=4)
    runner = Runner(executor)
    try:
        with runner.open_session() as s:
            out = s.generate_async(PROMPT * 2, GenConfig(max_new_tokens=5, prefill_chunk=3)).wait(60)
            assert s.content_digest() == content_digest(PROMPT * 2 + list(out.tokens[:-1]))
    finally:
        runner.shutdown()
