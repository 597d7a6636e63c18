"""A session saved to a file and loaded into a fresh engine continues exactly like a cold run over the
same tokens (greedy tokens equal, logits allclose), on both cache kinds, with ring layers wrapped or
not; a snapshot that does not fit the loading engine is refused with its reason and leaves nothing
resident. Tiny seeded model "FRFR", window 4 (as test_clone_equivalence).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.content import content_digest
from engine_service.api.snapshot_files import LoadRefusal, SaveRefusal
from engine_service.cache.seq_state import SeqState
from engine_service.executors.embeddings import EmbeddingsExecutor
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.prepared_input import EmbeddingsInput
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import read_snapshot, write_snapshot
from engine_service.runtime.runner import Runner
from engine_service.sessions.session_files import (
    encode_session,
    load_session,
    load_session_bytes,
    save_session,
)
from tests.model.test_clone_equivalence import KINDS, PROMPT, SUFFIX, assert_same, generate, recording
from tests.unit.runtime.conftest import collect_and_flush

MODEL_ID = "tiny-model-a"


@pytest.fixture
def engine(tiny_model):
    """Factory: (runner, executor) over a recording executor; every runner is shut down at the end."""
    runners = []
    models = {}

    def make(
        kind: str,
        *,
        window: int = 4,
        prefill_chunk: int = 4,
        model_id: str = MODEL_ID,
        max_sessions: int = 4,
        max_session_tokens: int = 128,
        cls=ModuleExecutor,
    ):
        if window not in models:
            models[window] = tiny_model("FRFR", window=window, tie_embeddings=False)
        ex = recording(cls).create(
            models[window],
            kind,
            max_sessions=max_sessions,
            max_session_tokens=max_session_tokens,
            prefill_chunk=prefill_chunk,
            kv_dtype="float32",  # warm vs cold at float32 tolerances; float16: test_kv_dtype.py
            keep_logits=True,
            model_fingerprint=model_id,
        )
        ex.log = []
        runner = Runner(ex, max_decode_sequences=4)
        runners.append(runner)
        return runner, ex

    yield make
    for runner in runners:
        runner.shutdown()


def cold(engine, kind, tokens, n, **kw):
    runner, ex = engine(kind, **kw)
    with runner.open_session() as s:
        return generate(ex, s, tokens, n)


def saved(engine, tmp_path, kind, *, decoded: int = 1, **kw):
    """Run PROMPT (+ decoded tokens) on a fresh engine, save the session, stop that engine.
    Returns (SaveOutcome, the content the session committed)."""
    runner, ex = engine(kind, **kw)
    session = runner.open_session()
    tokens, _ = generate(ex, session, PROMPT, decoded)
    outcome = save_session(session, tmp_path)
    assert outcome.saved, outcome
    content = PROMPT + tokens[:-1]  # the last token is pending: never written, never saved
    assert outcome.positions == len(content) == session.position
    runner.shutdown()  # the engine that saved it is gone: the load below is a restart
    return outcome, content


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("chunk", "decoded"), [(4, 1), (4, 6), (32, 1)])
def test_loaded_snapshot_continues_like_cold(engine, tmp_path, kind, chunk, decoded) -> None:
    outcome, content = saved(engine, tmp_path, kind, decoded=decoded, prefill_chunk=chunk)
    snap = read_snapshot(outcome.path)
    if kind == "batched-sequence":  # ring slots = window + max_write (one spare); 22+ positions wrap 8
        wrapped = snap.state.written > 4 + chunk
        assert wrapped == (chunk == 4)
        assert snap.state.arrays["layers.1.keys"].shape[1] == (4 + chunk if wrapped else len(content))
    runner, ex = engine(kind, prefill_chunk=chunk)
    loaded = load_session(runner, outcome.path)
    assert loaded.loaded, loaded
    session = loaded.session
    assert session.position == len(content) and loaded.content == tuple(content)
    assert session.content_digest() == content_digest(content) == outcome.content_digest
    # a digest-checked clone of the loaded session (what a prefix-cache hit does, replaying the last
    # token) works like one of a session that ran here
    child = session.clone_async(len(content) - 1, content_digest(content[:-1])).result(timeout=30)
    assert child is not None
    got = generate(ex, session, SUFFIX, 6)
    assert_same(got, cold(engine, kind, content + SUFFIX, 6, prefill_chunk=chunk))
    assert_same(
        generate(ex, child, content[-1:] + SUFFIX, 4),
        cold(engine, kind, content + SUFFIX, 4, prefill_chunk=chunk),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_saving_leaves_the_session_as_it_was(engine, tmp_path, kind) -> None:
    runner, ex = engine(kind)
    session = runner.open_session()
    first, _ = generate(ex, session, PROMPT, 3)
    assert save_session(session, tmp_path).saved
    # the next generation feeds the pending token, then the suffix: like a cold run over all of them
    assert_same(generate(ex, session, SUFFIX, 4), cold(engine, kind, PROMPT + first + SUFFIX, 4))


@pytest.mark.parametrize("kind", KINDS)
def test_negative_control_a_resigned_scrambled_snapshot_differs_from_cold(engine, tmp_path, kind) -> None:
    """The comparison can fail: the same file with the sliding layer's rows rolled by one (and a fresh,
    valid checksum) loads, and then does not continue like cold."""
    outcome, content = saved(engine, tmp_path, kind)
    snap = read_snapshot(outcome.path)
    arrays = dict(snap.state.arrays)
    for name in ("layers.1.keys", "layers.3.keys"):
        arrays[name] = np.roll(np.asarray(arrays[name]), 1, axis=1)
    arrays = {name: mx.array(a) for name, a in arrays.items()}
    mx.eval(list(arrays.values()))
    bad = SessionSnapshot(
        snap.fingerprint, snap.layout, SeqState(snap.positions, snap.state.written, arrays), snap.content
    )
    write_snapshot(tmp_path / "scrambled.safetensors", bad)
    runner, ex = engine(kind)
    loaded = load_session(runner, tmp_path / "scrambled.safetensors")
    assert loaded.loaded
    got = generate(ex, loaded.session, SUFFIX, 4)
    want = cold(engine, kind, content + SUFFIX, 4)
    assert not np.allclose(np.stack(got[1]), np.stack(want[1]), atol=1e-4)


def flip_tensor_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's bytes
    path.write_bytes(bytes(data))


def rewrite_version(path) -> None:
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.eval(list(arrays.values()))
    meta["format_version"] = "2"
    with open(path, "wb") as f:
        mx.save_safetensors(f, arrays, metadata=meta)


# case -> (what the loading engine differs in, how the file is damaged, the expected reason)
CASES = {
    "another_model": (dict(model_id="tiny-model-b"), None, LoadRefusal.FINGERPRINT),
    "another_cache_kind": (dict(kind="batched-cell"), None, LoadRefusal.CACHE_KIND),
    "another_window": (dict(window=6), None, LoadRefusal.GEOMETRY),
    "another_max_write": (dict(prefill_chunk=8), None, LoadRefusal.GEOMETRY),
    "truncated": ({}, lambda p: p.write_bytes(p.read_bytes()[:-100]), LoadRefusal.UNREADABLE),
    "flipped_byte": ({}, flip_tensor_byte, LoadRefusal.CHECKSUM),
    "format_version": ({}, rewrite_version, LoadRefusal.FORMAT_VERSION),
    "too_long": (dict(max_session_tokens=16), None, LoadRefusal.TOO_LONG),
    "control": ({}, None, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_snapshot_that_does_not_fit_is_refused_with_its_reason_and_nothing_leaks(
    engine, tmp_path, case
) -> None:
    differs, damage, reason = CASES[case]
    outcome, content = saved(engine, tmp_path, "batched-sequence")
    if damage is not None:
        damage(outcome.path)
    kw = dict(differs)
    runner, ex = engine(kw.pop("kind", "batched-sequence"), **kw)
    loaded = load_session(runner, outcome.path)
    runner.flush(10)
    if reason is None:  # the control: the same file loads into the same configuration
        assert loaded.loaded and runner.resident_sessions == 1
        return
    assert not loaded.loaded and loaded.refusal == reason, loaded
    assert loaded.detail
    assert runner.resident_sessions == 0 and ex.resident_sessions == 0 and ex.cache.used() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_no_room_is_refused_and_the_resident_sessions_are_untouched(engine, tmp_path, kind) -> None:
    outcome, _ = saved(engine, tmp_path, kind)
    runner, ex = engine(kind, max_sessions=1)
    held = runner.open_session()
    generate(ex, held, [1, 2, 3], 2)
    used = ex.cache.used()
    loaded = load_session(runner, outcome.path)
    assert loaded.refusal == LoadRefusal.NO_ROOM
    runner.flush(10)
    assert runner.resident_sessions == 1 and ex.cache.used() == used
    held.close()
    runner.flush(10)
    assert load_session(runner, outcome.path).loaded  # control: with the slot free it loads


def test_save_refusals(engine, tmp_path, tiny_model) -> None:
    runner, ex = engine("batched-sequence")
    closed = runner.open_session()
    closed.close()
    assert save_session(closed, tmp_path).refusal == SaveRefusal.SOURCE_UNUSABLE
    runner, ex = engine("batched-sequence", cls=EmbeddingsExecutor)
    session = runner.open_session()
    model = ex.model
    generate(ex, session, EmbeddingsInput(model.embed(mx.array(PROMPT[:5], dtype=mx.int32))), 1)
    assert save_session(session, tmp_path).refusal == SaveRefusal.PREPARED_INPUT
    stopped, _ = engine("batched-sequence")
    session = stopped.open_session()
    stopped.shutdown()
    assert save_session(session, tmp_path).refusal == SaveRefusal.SOURCE_UNUSABLE
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("keep", [False, True])
def test_a_dropped_import_future_never_leaks_a_session(engine, tmp_path, keep) -> None:
    outcome, _ = saved(engine, tmp_path, "batched-cell")
    runner, ex = engine("batched-cell")
    snap = read_snapshot(outcome.path)
    futures = [runner.import_async(snap) for _ in range(3)]
    if not keep:
        futures.clear()  # skipped if still queued, closed by the session's finalizer if it ran
    collect_and_flush(runner)
    assert runner.resident_sessions == (3 if keep else 0)
    assert ex.cache.used() == (3 * len(snap.content) if keep else 0)


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_over_the_wire_load_like_the_file(engine, tmp_path, kind) -> None:
    """What an export/import RPC pair carries: the file's bytes; damaged bytes are refused alike."""
    runner, ex = engine(kind)
    session = runner.open_session()
    tokens, _ = generate(ex, session, PROMPT, 1)
    encoded = encode_session(session, extra={"namespace": "ns"})
    assert encoded.data is not None and encoded.positions == len(PROMPT)
    assert encoded.content_digest == content_digest(PROMPT)
    other, other_ex = engine(kind)
    loaded = load_session_bytes(other, encoded.data, source="engine-a")
    assert (
        loaded.loaded and dict(loaded.extra) == {"namespace": "ns"} and loaded.file_bytes == len(encoded.data)
    )
    assert_same(generate(other_ex, loaded.session, SUFFIX, 4), cold(engine, kind, PROMPT + SUFFIX, 4))
    bad = bytearray(encoded.data)
    bad[-2] ^= 0x04
    refused = load_session_bytes(other, bytes(bad), source="engine-a")
    assert refused.refusal == LoadRefusal.CHECKSUM and "engine-a" in refused.detail
    other.flush(10)
    assert other.resident_sessions == 1
    session.close()
    assert encode_session(session).refusal == SaveRefusal.SOURCE_UNUSABLE
