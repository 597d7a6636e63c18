"""PromptCapture against the fake backend and the fake generation driver (runner-like ordering)."""

from __future__ import annotations

import pytest

from engine_service.api.errors import FailedPrecondition
from prefix_service.cache.prefix_cache import PrefixCache
from tests.unit.prefix.fakes import FakeBackend, FakeUpdate, fake_generate

NS = "app"
WINDOW = 4
PROMPT = tuple(range(100, 112))  # 12 tokens


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(deferred=True)


class Recorder:
    def __init__(self) -> None:
        self.updates: list[FakeUpdate] = []

    def __call__(self, update: FakeUpdate) -> None:
        self.updates.append(update)


def test_capture_happens_before_decode_destroys_retention(backend, cache):
    source = backend.open(())
    capture = cache.capture_prompt(source, PROMPT)
    fake_generate(backend, source, PROMPT, capture.wrap(None), new_tokens=(1, 2, 3, 4, 5, 6), window=WINDOW)
    # Negative control: after decode, the source itself can no longer be cloned at the prompt length.
    assert backend.clone(source, len(PROMPT)) is None
    assert capture.collect(NS) == 1
    match = cache.lookup(NS, PROMPT).match
    assert match.reused == len(PROMPT) - 1 and match.session.tokens == PROMPT[:-1]
    assert cache.entries()[0].metadata["boundary"] == "prompt"


def test_capture_clones_before_forwarding_and_forwards_every_update(backend, cache):
    source = backend.open(())
    seen_clones: list[int] = []
    recorder = Recorder()

    def user(update: FakeUpdate) -> None:
        seen_clones.append(len(backend.clone_calls) + len(backend._queue))
        recorder(update)

    capture = cache.capture_prompt(source, PROMPT)
    fake_generate(backend, source, PROMPT, capture.wrap(user))
    assert seen_clones[0] == 1  # the clone was already queued when the first update arrived
    assert [u.tokens for u in recorder.updates] == [(500,), (501,), (502,), ()]
    assert capture.requested == (len(PROMPT),)


def test_capture_copies_the_callers_tokens(backend, cache):
    prompt = list(PROMPT)
    source = backend.open(())
    capture = cache.capture_prompt(source, prompt)
    prompt[3] = 9999
    prompt.append(7)
    fake_generate(backend, source, PROMPT, capture.wrap(None))
    assert capture.collect(NS) == 1
    assert cache.entries()[0].tokens == PROMPT


@pytest.mark.parametrize("failure", ["capacity", "allocation"])
def test_refusal_during_capture_collects_nothing_twice(backend, cache, failure):
    prompt = list(PROMPT)
    source = backend.open(())
    if failure == "capacity":
        backend.capacity = 1  # only the source fits
    else:
        backend.fail_next = 1
    capture = cache.capture_prompt(source, prompt)
    fake_generate(backend, source, PROMPT, capture.wrap(None))
    assert capture.collect(NS) == 0
    assert capture.collect(NS) == 0
    assert prompt == list(PROMPT) and len(cache) == 0
    assert backend.live == {source}
    assert cache.stats().refusals["capture_refused"] == 1


def test_user_callback_exception_propagates(backend, cache):
    source = backend.open(())
    capture = cache.capture_prompt(source, PROMPT)

    def boom(update: FakeUpdate) -> None:
        raise RuntimeError("user callback failed")

    with pytest.raises(RuntimeError, match="user callback failed"):
        capture.wrap(boom)(FakeUpdate(tokens=(1,), position=len(PROMPT)))


def test_rejected_generation_captures_nothing_and_empty_updates_do_not_use_it_up(backend, cache):
    source = backend.open(PROMPT)
    capture = cache.capture_prompt(source, PROMPT)
    wrapped = capture.wrap(None)
    wrapped(FakeUpdate(position=len(PROMPT), finished=True, finish_reason="error", error="rejected"))
    assert capture.requested == ()
    second = cache.capture_prompt(source, PROMPT)
    wrapped = second.wrap(None)
    wrapped(FakeUpdate(position=len(PROMPT)))  # empty update
    wrapped(FakeUpdate(tokens=(5,), position=len(PROMPT)))
    backend.run_pending()
    assert second.collect(NS) == 1
    assert capture.collect(NS) == 0


def test_capture_queued_before_user_closes_source_still_succeeds(backend, cache):
    source = backend.open(())
    capture = cache.capture_prompt(source, PROMPT)

    def close_source(update: FakeUpdate) -> None:
        if update.tokens:
            backend.close(source)

    recorder = Recorder()

    def user(update: FakeUpdate) -> None:
        close_source(update)
        recorder(update)

    fake_generate(backend, source, PROMPT, capture.wrap(user))
    assert source.closed
    assert recorder.updates[-1].finish_reason == "cancelled"
    assert capture.collect(NS) == 1
    assert cache.lookup(NS, PROMPT).match.session.tokens == PROMPT[:-1]


def test_copied_callbacks_capture_once_and_collect_once(backend, cache):
    source = backend.open(PROMPT)
    capture = cache.capture_prompt(source, PROMPT)
    first, second = capture.wrap(None), capture.wrap(Recorder())
    first(FakeUpdate(tokens=(1,), position=len(PROMPT)))
    second(FakeUpdate(tokens=(1,), position=len(PROMPT)))
    backend.run_pending()
    assert len(backend.clone_calls) == 1
    assert capture.collect(NS) == 1
    assert capture.collect(NS) == 0
    assert len(cache) == 1


def test_capture_keeps_the_original_session_after_reassignment(backend, cache):
    source = backend.open(PROMPT)
    original_id = source.id
    capture = cache.capture_prompt(source, PROMPT)
    wrapped = capture.wrap(None)
    source = backend.open(PROMPT[:3])  # the caller's variable now names another session
    wrapped(FakeUpdate(tokens=(1,), position=len(PROMPT)))
    backend.run_pending()
    assert backend.clone_calls == [(original_id, len(PROMPT))]
    assert capture.collect(NS) == 1


def test_closed_source_forwards_without_retaining(backend, cache):
    source = backend.open(PROMPT)
    backend.close(source)
    backend.run_pending()
    capture = cache.capture_prompt(source, PROMPT)
    assert not capture.active
    recorder = Recorder()
    capture.wrap(recorder)(FakeUpdate(tokens=(1,), position=len(PROMPT)))
    capture.wrap(None)(FakeUpdate(tokens=(1,), position=len(PROMPT)))  # no callback is fine too
    assert len(recorder.updates) == 1 and backend.clone_calls == []
    assert capture.collect(NS) == 0


def test_discarded_capture_releases_its_clone_and_keeps_forwarding(backend, cache):
    source = backend.open(PROMPT)
    capture = cache.capture_prompt(source, PROMPT)
    recorder = Recorder()
    wrapped = capture.wrap(recorder)
    wrapped(FakeUpdate(tokens=(1,), position=len(PROMPT)))
    capture.discard()
    backend.run_pending()  # the clone settles after the discard: it must still be released
    backend.run_pending()  # ... through a queued close
    wrapped(FakeUpdate(tokens=(2,), position=len(PROMPT) + 1))
    assert len(recorder.updates) == 2
    assert backend.live == {source}
    assert capture.collect(NS) == 0 and len(cache) == 0


def test_breakpoint_checkpoint_serves_a_prompt_sharing_only_the_system_part(backend, cache):
    system = PROMPT[:8]
    source = backend.open(())
    capture = cache.capture_prompt(source, PROMPT)
    wrapped = capture.wrap(None)
    fake_generate(backend, source, PROMPT, wrapped, window=WINDOW, breakpoints=(len(system), 50))
    assert capture.requested == (len(system), len(PROMPT))  # 50 is past the prompt: ignored
    assert capture.collect(NS) == 2
    boundaries = {entry.tokens: entry.metadata["boundary"] for entry in cache.entries()}
    assert boundaries == {system: "breakpoint", PROMPT: "prompt"}
    other = system + (7, 7, 7)
    match = cache.lookup(NS, other).match
    assert match.reused == len(system) and match.session.tokens == system


def test_observer_alone_takes_only_checkpoints(backend, cache):
    source = backend.open(())
    capture = cache.capture_prompt(source, PROMPT)
    fake_generate(backend, source, PROMPT, capture.observer, breakpoints=(4, 8))
    assert capture.requested == (4, 8)
    assert capture.collect(NS, metadata={"priority": "3"}) == 2
    assert all(e.metadata == {"priority": "3", "boundary": "breakpoint"} for e in cache.entries())


def test_capture_needs_a_backend_that_queues_clones():
    backend = FakeBackend()
    plain = PrefixCache(backend, 4)
    assert plain.capture_prompt(backend.open(PROMPT), PROMPT).active

    class NoAsync:
        fingerprint = "x"

        def clone(self, handle, upto):
            return None

        def close(self, handle):
            pass

        def position(self, handle):
            return 0

        def valid(self, handle):
            return True

    with pytest.raises(FailedPrecondition):
        PrefixCache(NoAsync(), 4).capture_prompt(object(), PROMPT)
