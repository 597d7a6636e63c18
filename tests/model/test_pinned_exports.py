"""A clone's (or an import's) export is served on the calling thread from its pinned views, while the
engine thread is busy, and what it gives is exactly what the engine thread's export gives: loaded into a
fresh engine it continues like a cold run over the same tokens, whole or any prefix of it, with ring
layers wrapped or not, in every K/V dtype, float32 and q8_0 weights. Negative controls: an ordinary session's export waits for the
busy engine thread; a generation on the clone drops the pin (its later export includes the new
positions). Tiny seeded model "FRFR", window 4 (as test_clone_equivalence).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.config import GenConfig
from engine_service.api.snapshot_files import SaveRefusal
from engine_service.persistence.snapshot import mlx_state
from engine_service.runtime.runner import Runner
from engine_service.sessions.session_files import encode_session, load_session_bytes
from tests.model import test_clone_equivalence as clone_tests
from tests.model.test_clone_equivalence import PROMPT, SUFFIX, assert_same, generate

SEQUENCE = "batched-sequence"
# test_clone_equivalence's fixtures: a (runner, executor) factory over float32 and q8_0 weights
engine, model = clone_tests.engine, clone_tests.model


def cold(engine, tokens, n, **kw):
    runner, ex = engine(SEQUENCE, **kw)
    with runner.open_session() as s:
        return generate(ex, s, tokens, n)


class BusyEngine:
    """Holds the engine thread inside a generation's callback until released (a forward that runs)."""

    def __init__(self, runner: Runner) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self._session = runner.open_session()

        def hold(update) -> None:
            self.entered.set()
            self.release.wait(30)

        self._handle = self._session.generate_async([1, 2, 3], GenConfig(max_new_tokens=2), callback=hold)
        assert self.entered.wait(30)

    def __enter__(self) -> BusyEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self._handle.wait(30)
        self._session.close()


def snapshot_of(runner, ex, prompt=PROMPT):
    """A session that ran ``prompt`` + 1 token and a clone of its committed positions (pinned)."""
    source = runner.open_session()
    generate(ex, source, list(prompt), 2)
    clone = source.clone_async(source.position).result(30)
    assert clone is not None
    return source, clone


@pytest.mark.parametrize(
    ("chunk", "kv_dtype"), [(4, "float32"), (32, "float32"), (4, "float16"), (4, "bfloat16")]
)
def test_a_clone_exports_while_the_engine_thread_is_busy_like_the_engine_thread_would(
    engine, chunk, kv_dtype
) -> None:
    runner, ex = engine(SEQUENCE, prefill_chunk=chunk, kv_dtype=kv_dtype)
    source, clone = snapshot_of(runner, ex)
    content = tuple(clone._record.content.values(clone.position))
    assert clone._record.pinned is not None and source._record.pinned is None
    with BusyEngine(runner):
        pinned = clone.export_async()
        assert pinned.done()  # served here: the engine thread is held inside a forward
        waiting = source.export_async()  # negative control: an ordinary export waits for that thread
        assert not waiting.done()
    on_thread = waiting.result(30)
    snap = pinned.result(0)
    assert snap is not None and on_thread is not None
    assert snap.content == on_thread.content == content and snap.positions == on_thread.positions
    assert set(snap.state.arrays) == set(on_thread.state.arrays)
    got, want = mlx_state(snap.state), mlx_state(on_thread.state)
    for name in want.arrays:
        assert got.arrays[name].dtype == want.arrays[name].dtype == getattr(mx, kv_dtype), name
        assert mx.array_equal(got.arrays[name], want.arrays[name]).item(), name
    # over the wire into a fresh engine: continues like a cold run over the same tokens
    other, other_ex = engine(SEQUENCE, prefill_chunk=chunk, kv_dtype=kv_dtype)
    loaded = load_session_bytes(other, encode_session(clone).data, source="pinned")
    assert loaded.loaded, loaded
    assert_same(
        generate(other_ex, loaded.session, list(SUFFIX), 4),
        cold(engine, list(content) + list(SUFFIX), 4, prefill_chunk=chunk, kv_dtype=kv_dtype),
    )


@pytest.mark.parametrize(("chunk", "prompt"), [(4, PROMPT), (32, PROMPT), (4, PROMPT[:8])])
def test_a_prefix_export_continues_like_cold_or_is_refused_below_the_ring_floor(
    engine, chunk, prompt
) -> None:
    """With chunk 4 the ring has 7 slots (window 4 + 4 - 1): 23 positions wrap it far past the floor;
    9 wrap it just, so the floor (5) lies below the slot count and the prefix still reads every slot."""
    runner, ex = engine(SEQUENCE, prefill_chunk=chunk)
    _, clone = snapshot_of(runner, ex, prompt)
    content = list(clone._record.content.values(clone.position))
    floor = ex.clone_floor(clone._record.sid)
    assert (floor > 0) == (chunk == 4)
    upto = floor if floor > 0 else 9
    with BusyEngine(runner):
        prefix = clone.export_async(upto)
        assert prefix.done()
    snap = prefix.result(0)
    assert snap is not None and snap.positions == upto and list(snap.content) == content[:upto]
    other, other_ex = engine(SEQUENCE, prefill_chunk=chunk)
    loaded = load_session_bytes(other, encode_session(clone, upto=upto).data, source="pinned")
    assert loaded.loaded and loaded.session.position == upto, loaded
    assert_same(
        generate(other_ex, loaded.session, list(SUFFIX), 4),
        cold(engine, content[:upto] + list(SUFFIX), 4, prefill_chunk=chunk),
    )
    if floor > 0:  # below the floor the wrapped ring no longer holds the rows
        below = clone.export_async(floor - 1)
        assert below.result(0) is None and below.refusal == SaveRefusal.BOUNDARY
    past = clone.export_async(len(content) + 1)
    assert past.result(0) is None and past.refusal == SaveRefusal.BOUNDARY


def test_a_generation_on_the_clone_drops_the_pin_and_later_exports_hold_its_positions(engine) -> None:
    runner, ex = engine(SEQUENCE)
    _, clone = snapshot_of(runner, ex)
    before = clone.position
    tokens, _ = generate(ex, clone, list(SUFFIX), 3)
    assert clone._record.pinned is None
    snap = clone.export_async().result(30)
    assert snap is not None and snap.positions == before + len(SUFFIX) + 2  # the last token is pending
    other, other_ex = engine(SEQUENCE)
    loaded = load_session_bytes(other, encode_session(clone).data, source="after")
    assert loaded.loaded, loaded
    content = list(snap.content)
    assert_same(generate(other_ex, loaded.session, [5, 6], 3), cold(engine, content + [5, 6], 3))


def test_the_cell_cache_does_not_pin_and_exports_on_the_engine_thread(engine) -> None:
    runner, ex = engine("batched-cell")
    source, clone = snapshot_of(runner, ex)
    assert clone._record.pinned is None and not runner.pins_exports
    snap = clone.export_async(10).result(30)
    assert snap is not None and snap.positions == 10
    np.testing.assert_array_equal(np.asarray(snap.content), np.asarray(clone._record.content.values(10)))
