"""The prefix cache over a real Runner + ModuleExecutor (tiny seeded model) through RunnerBackend.

A run that resumes from a cached snapshot must equal a cold run of the whole request: same greedy
tokens, logits allclose. The negative control resumes the same suffix from a snapshot of a different
prompt and must differ, so the comparison cannot pass vacuously.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from clients.runner_backend import RunnerBackend
from engine_service.api.config import GenConfig
from engine_service.executors.base import Executor
from engine_service.executors.module import ModuleExecutor
from engine_service.runtime.runner import Runner
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.session_backend import CaptureBackend, SessionBackend
from tests.unit.executors.helpers import reference_greedy

NS = "test"
NEW = 5
TIMEOUT = 120


class LogitRecorder(Executor):
    """Delegates to a keep_logits ModuleExecutor and records the logits behind every returned token
    (one generation at a time in these tests, so the log belongs to the running one)."""

    def __init__(self, inner: ModuleExecutor) -> None:
        self.inner = inner
        self.logits: list[np.ndarray] = []

    def execute(self, batch):
        outputs = self.inner.execute(batch)
        self.logits.extend(np.array(out.logits) for out in outputs if out.tokens and out.logits is not None)
        return outputs

    def open_session(self):
        return self.inner.open_session()

    def close_session(self, sid):
        self.inner.close_session(sid)

    def clone(self, sid, upto):
        return self.inner.clone(sid, upto)

    def set_sampling(self, sid, params, seed):
        self.inner.set_sampling(sid, params, seed)

    def preferred_batch_tokens(self):
        return self.inner.preferred_batch_tokens()

    def limits(self):
        return self.inner.limits()

    def fingerprint(self):
        return self.inner.fingerprint()


@pytest.fixture
def engine(tiny_model, request):
    """(runner, recorder, model) for a cache kind; ``prefill_chunk`` small so ring layers wrap."""
    kind, chunk = request.param
    model = tiny_model("FRFR", window=4, seed=3)
    recorder = LogitRecorder(
        ModuleExecutor.create(
            model, kind, max_sessions=8, max_session_tokens=128, keep_logits=True, prefill_chunk=chunk
        )
    )
    runner = Runner(recorder, max_decode_sequences=4)
    yield runner, recorder, model
    runner.shutdown()


BOTH_KINDS = [("batched-sequence", 4), ("batched-cell", 4)]


def generate(session, tokens: Sequence[int], recorder: LogitRecorder, callback=None, **config):
    recorder.logits.clear()
    handle = session.generate_async(list(tokens), GenConfig(max_new_tokens=NEW, **config), callback)
    result = handle.wait(TIMEOUT)
    assert result.finish_reason == "length", result.error
    return list(result.tokens), np.stack(recorder.logits)


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 128, size=n)]


def cached(runner, recorder, prompt, **config) -> PrefixCache:
    """A cache holding the snapshot that capture took while ``prompt`` generated cold."""
    cache = PrefixCache(RunnerBackend(runner), max_entries=8)
    session = runner.open_session()
    capture = cache.capture_prompt(session, prompt)
    generate(session, prompt, recorder, capture.wrap(None), **config)
    assert capture.collect(NS) >= 1
    session.close()
    return cache


@pytest.mark.parametrize("engine", BOTH_KINDS, indirect=True)
@pytest.mark.parametrize("extra", [0, 1, 6])
def test_suffix_run_after_hit_equals_cold_run(engine, extra):
    runner, recorder, model = engine
    prompt = prompt_of(14, seed=1)
    cache = cached(runner, recorder, prompt)
    request = prompt + prompt_of(extra, seed=2)
    match = cache.lookup(NS, request).match
    assert match is not None and match.reused == min(len(prompt), len(request) - 1)
    assert match.session.position == match.reused
    warm_tokens, warm_logits = generate(match.session, request[match.reused :], recorder)
    cold_tokens, cold_logits = generate(runner.open_session(), request, recorder)
    ref_tokens, _ = reference_greedy(model, request, NEW)
    assert warm_tokens == cold_tokens == ref_tokens
    np.testing.assert_allclose(warm_logits, cold_logits, atol=1e-4, rtol=1e-4)

    # Negative control: the same suffix on a snapshot of another prompt of the same length differs.
    other = prompt_of(len(prompt), seed=9)
    other_cache = cached(runner, recorder, other)
    wrong = other_cache.lookup(NS, other + request[len(prompt) :]).match
    _, wrong_logits = generate(wrong.session, request[wrong.reused :], recorder)
    assert not np.allclose(wrong_logits, cold_logits, atol=1e-2)


@pytest.mark.parametrize("engine", BOTH_KINDS, indirect=True)
def test_breakpoint_checkpoint_serves_prompt_sharing_only_the_system_part(engine):
    runner, recorder, model = engine
    system = prompt_of(10, seed=4)
    first = system + prompt_of(6, seed=5)
    cache = PrefixCache(RunnerBackend(runner), max_entries=8)
    session = runner.open_session()
    capture = cache.capture_prompt(session, first)
    generate(session, first, recorder, capture.wrap(None), prefill_breakpoints=(len(system),))
    assert capture.collect(NS) == 2
    assert {e.metadata["boundary"]: len(e.tokens) for e in cache.entries()} == {
        "breakpoint": len(system),
        "prompt": len(first),
    }
    second = system + prompt_of(7, seed=6)
    assert second[len(system)] != first[len(system)]
    match = cache.lookup(NS, second).match
    assert match.reused == len(system)
    warm_tokens, warm_logits = generate(match.session, second[len(system) :], recorder)
    cold_tokens, cold_logits = generate(runner.open_session(), second, recorder)
    assert warm_tokens == cold_tokens
    np.testing.assert_allclose(warm_logits, cold_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", [("batched-sequence", 2)], indirect=True)
def test_sliding_window_snapshot_from_wrap_survives_decode(engine):
    """Ring layers keep window + max_write (one spare) = 6 slots: decode overwrites the prompt boundary."""
    runner, recorder, model = engine
    prompt = prompt_of(12, seed=7)
    cache = PrefixCache(RunnerBackend(runner), max_entries=8)
    source = runner.open_session()
    capture = cache.capture_prompt(source, prompt)
    generate(source, prompt, recorder, capture.wrap(None))
    # Negative control: after decode the source can no longer be cloned at the prompt length.
    assert source.clone_async(len(prompt)).result(TIMEOUT) is None
    assert capture.collect(NS) == 1
    request = prompt + [5, 6, 7]
    match = cache.lookup(NS, request).match
    assert match.reused == len(prompt)
    warm_tokens, warm_logits = generate(match.session, request[len(prompt) :], recorder)
    cold_tokens, cold_logits = generate(runner.open_session(), request, recorder)
    assert warm_tokens == cold_tokens
    np.testing.assert_allclose(warm_logits, cold_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", [("batched-sequence", 4)], indirect=True)
def test_cache_and_sessions_outlive_the_runner(engine):
    runner, recorder, _ = engine
    prompt = prompt_of(8, seed=8)
    cache = cached(runner, recorder, prompt)
    handed_out = cache.lookup(NS, prompt).match.session
    before = runner.metrics().clones_succeeded + runner.metrics().clones_refused
    runner.shutdown()
    assert not handed_out.valid
    assert cache.lookup(NS, prompt).match is None
    assert runner.metrics().clones_succeeded + runner.metrics().clones_refused == before
    assert len(cache) == 0
    cache.clear()


@pytest.mark.parametrize("engine", [("batched-sequence", 4)], indirect=True)
def test_the_local_backend_is_a_capture_backend(engine):
    # engine_service never imports prefix_service: the protocol is met structurally, checked here
    runner, _, _ = engine
    backend = RunnerBackend(runner)
    assert isinstance(backend, CaptureBackend) and isinstance(backend, SessionBackend)
    missing = [name for name in ("clone_or_refusal", "max_rewind") if not hasattr(backend, name)]
    assert missing == []  # the optional parts the cache asks for by name
    assert not isinstance(object(), SessionBackend)  # negative control: the check can fail


@pytest.mark.parametrize("engine", [("batched-sequence", 4)], indirect=True)
def test_namespace_carries_the_engine_fingerprint(engine):
    runner, recorder, _ = engine
    backend = RunnerBackend(runner)
    assert backend.fingerprint == runner.fingerprint and backend.fingerprint
    cache = cached(runner, recorder, prompt_of(8, seed=10))
    assert cache.entries()[0].namespace == (runner.fingerprint, NS)


@pytest.mark.parametrize("engine", [("batched-sequence", 4)], indirect=True)
def test_user_callback_exception_fails_the_generation_with_its_message(engine):
    runner, _, _ = engine
    prompt = prompt_of(8, seed=11)
    cache = PrefixCache(RunnerBackend(runner), max_entries=8)
    session = runner.open_session()
    capture = cache.capture_prompt(session, prompt)

    def boom(update):
        if update.tokens:
            raise RuntimeError("user callback exploded")

    result = session.generate_async(prompt, GenConfig(max_new_tokens=NEW), capture.wrap(boom)).wait(TIMEOUT)
    assert result.finish_reason == "error" and "user callback exploded" in result.error
    assert capture.collect(NS) == 1  # the clone was queued before the callback ran


@pytest.mark.parametrize("engine", [("batched-sequence", 4)], indirect=True)
def test_capture_queued_before_the_callback_closes_the_source_succeeds(engine):
    runner, recorder, _ = engine
    prompt = prompt_of(9, seed=12)
    cache = PrefixCache(RunnerBackend(runner), max_entries=8)
    session = runner.open_session()
    capture = cache.capture_prompt(session, prompt)

    def close_source(update):
        if update.tokens:
            session.close()

    result = session.generate_async(prompt, GenConfig(max_new_tokens=NEW), capture.wrap(close_source)).wait(
        TIMEOUT
    )
    assert result.finish_reason == "cancelled"
    assert capture.collect(NS) == 1
    match = cache.lookup(NS, prompt).match
    warm_tokens, _ = generate(match.session, prompt[match.reused :], recorder)
    cold_tokens, _ = generate(runner.open_session(), prompt, recorder)
    assert warm_tokens == cold_tokens


def capture_into(cache: PrefixCache, runner, recorder, prompt) -> None:
    session = runner.open_session()
    capture = cache.capture_prompt(session, prompt)
    generate(session, prompt, recorder, capture.wrap(None))
    assert capture.collect(NS) == 1
    session.close()


@pytest.mark.parametrize("engine", BOTH_KINDS, indirect=True)
def test_a_branch_point_serves_the_groups_third_prompt_like_a_cold_run(engine):
    """Two prompts sharing 12 positions leave a branch point (a clone at 12 taken at the second's
    insert; on the ring only the second's snapshot is within reach); a third reuses it exactly."""
    runner, recorder, model = engine
    shared = prompt_of(12, seed=13)
    cache = PrefixCache(RunnerBackend(runner), max_entries=8, branch_min=8)
    capture_into(cache, runner, recorder, shared + prompt_of(6, seed=14))
    capture_into(cache, runner, recorder, shared + prompt_of(3, seed=15))
    branch = [e for e in cache.entries() if e.is_branch]
    assert [e.tokens for e in branch] == [tuple(shared)] and branch[0].snapshot.position == len(shared)
    third = shared + prompt_of(5, seed=16)
    assert third[len(shared)] not in (prompt_of(6, seed=14)[0], prompt_of(3, seed=15)[0])
    match = cache.lookup(NS, third).match
    assert match.reused == len(shared)
    warm_tokens, warm_logits = generate(match.session, third[len(shared) :], recorder)
    cold_tokens, cold_logits = generate(runner.open_session(), third, recorder)
    assert warm_tokens == cold_tokens == reference_greedy(model, third, NEW)[0]
    np.testing.assert_allclose(warm_logits, cold_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("kind", "layers", "share", "ring_limit"),
    [
        ("batched-sequence", "FFFF", 1.0, 0),
        ("batched-sequence", "FSSS", 0.25, 4 + 8),  # window 4 + max_write 8: rings shared until then
        ("batched-cell", "FSSS", 1.0, 0),
    ],
)
def test_the_local_backend_says_how_much_clones_share(tiny_model, kind, layers, share, ring_limit):
    runner = Runner(
        ModuleExecutor.create(
            tiny_model(layers, seed=3), kind, max_sessions=2, max_session_tokens=32, max_write=8
        )
    )
    try:
        backend = RunnerBackend(runner)
        assert (backend.clone_shared_share, backend.clone_shared_ring_positions) == (share, ring_limit)
    finally:
        runner.shutdown()
