"""Several generations at once, with clones and cancels from callbacks and from other threads."""

from __future__ import annotations

import gc
import threading

from engine_service.api.config import GenConfig
from tests.unit.runtime.conftest import VOCAB, Recorder, collect_and_flush, engine_paused
from tests.unit.runtime.fake_executor import FakeExecutor, reference

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20, 21, 22, 23]]


def test_four_generations_with_clones_and_cancels_return_to_baseline(make_runner):
    fake = FakeExecutor(vocab_size=VOCAB, max_sessions=64, preferred_batch_tokens=6)
    runner = make_runner(fake, max_decode_sequences=3)
    baseline = runner.resident_sessions
    sessions = [runner.open_session() for _ in PROMPTS]
    kept: list = []  # clone futures whose children we verify, then close
    handles = []

    def make_observer(i):
        def observe(update):
            s = sessions[i]
            if i == 0 and update.position > 0:
                kept.append((i, update.position, s.clone_async(update.position)))  # a clone per update
            elif i == 1:
                s.clone_async(update.position)  # abandoned at once: never runs
            elif i == 2 and len(update.tokens) and update.position >= 7:
                handles[2].cancel()
            elif i == 3 and update.finished:
                kept.append((i, update.position, s.clone_async(update.position)))

        return observe

    recorders = [Recorder(runner, make_observer(i)) for i in range(4)]
    with engine_paused(runner, fake):
        for i, (s, prompt) in enumerate(zip(sessions, PROMPTS, strict=True)):
            cfg = GenConfig(max_new_tokens=10, prefill_chunk=2 + i, seed=i)
            handles.append(s.generate_async(prompt, cfg, recorders[i]))
    # A clone from another thread while the engine runs (upto 0: valid whatever the timing).
    outside = threading.Thread(target=lambda: kept.append((0, 0, sessions[0].clone_async(0))))
    outside.start()
    outside.join()
    results = [h.wait(10) for h in handles]
    assert all(r.wrong_thread == 0 for r in recorders)
    for i in (0, 1, 3):
        assert results[i].finish_reason == "length"
        assert results[i].tokens == tuple(reference(PROMPTS[i], i, 10, VOCAB)), i
    assert results[2].finish_reason == "cancelled"
    assert results[2].tokens == tuple(reference(PROMPTS[2], 2, len(results[2].tokens), VOCAB))
    # The forwards really mixed sessions.
    assert max(len({inp.sid for inp in b}) for b in fake.batches) >= 3
    histories = [p + list(r.tokens) for p, r in zip(PROMPTS, results, strict=True)]
    for i, upto, future in kept:
        child = future.result(10)
        assert child is not None and child.position == upto
        out = child.generate_async([5], GenConfig(max_new_tokens=2)).wait(10)
        assert out.tokens == tuple(reference(histories[i][:upto] + [5], 0, 2, VOCAB))
        child.close()
    del child, future
    kept.clear()
    for s in sessions:
        s.close()
    del sessions[:], handles[:], recorders
    gc.collect()
    collect_and_flush(runner)
    assert runner.resident_sessions == baseline
    assert fake.seqs == {}
