"""The executor's decode lookahead (``ModuleExecutor(lookahead=True)``) is invisible: every scenario a
Runner drives -- greedy and seeded sampling, both cache kinds, several sessions decoding together,
sessions joining and leaving mid-decode, a clone / close / export right after a decode step, a stop
token, a max_new_tokens end and a follow-up turn -- returns the same tokens, positions and exported
K/V as lookahead off (the independent reference), while the lookahead is actually used. Negative
controls: a lookahead that does not restore the samplers' keys, or that ignores a changed input
token, is caught by the same comparisons."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.api.config import GenConfig
from engine_service.cache.sequence_cache import SequenceCache
from engine_service.executors.base import ExecInput
from engine_service.executors.lookahead import Lookahead
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.sampling import SamplingParams
from engine_service.model.cpu_kernels import kernels
from engine_service.runtime.runner import Runner

# sliding-window rings on batched-sequence take a discarded row back through their spare slot
SETUPS = (("batched-sequence", "FFFF"), ("batched-sequence", "FRFR"), ("batched-cell", "FRFR"))
PROMPTS = ([17, 4, 99, 23, 56, 8, 71], [3, 88, 41, 7, 19], [120, 66, 5, 90, 33, 47, 2, 81], [26, 110, 9])
SAMPLED = GenConfig(max_new_tokens=14, temperature=0.9, top_k=40, seed=7)


def greedy(n: int, **kw) -> GenConfig:
    return GenConfig(max_new_tokens=n, **kw)


def make_runner(model, kind: str, lookahead: bool) -> tuple[Runner, ModuleExecutor]:
    ex = ModuleExecutor.create(model, kind, max_sessions=8, max_session_tokens=96, prefill_chunk=4,
                               lookahead=lookahead)  # fmt: skip
    return Runner(ex, max_decode_sequences=4), ex


def wait(handle) -> tuple[tuple[int, ...], str]:
    result = handle.wait(60)
    assert result.error is None, result.error
    return tuple(result.tokens), str(result.finish_reason)


def join_and_leave(runner: Runner, ex: ModuleExecutor, seen: dict) -> dict:
    """Three sessions start together (one greedy, one sampled, one short that leaves early); when the
    first has 4 tokens a fourth joins (its prefill runs beside the others' decode), and right after its
    10th token's decode step a clone and an export are queued from its callback."""
    got: dict = {}
    s = [runner.open_session() for _ in range(4)]
    count = [0]
    late: list = []

    def first(update) -> None:
        count[0] += len(update.tokens)
        if update.tokens and count[0] == 4:
            late.append(s[3].generate_async(PROMPTS[3], greedy(9)))
        if update.tokens and count[0] == 10:
            got["clone_at"] = update.position
            seen["pending_at_clone"] = (
                ex._lookahead.pending is not None
            )  # the clone and export meet a queued step
            late.append(s[0].clone_async(update.position))
            late.append(s[0].export_async())

    handles = [
        s[0].generate_async(PROMPTS[0], greedy(12), first),
        s[1].generate_async(PROMPTS[1], SAMPLED),
        s[2].generate_async(PROMPTS[2], greedy(3)),
    ]
    got["outs"] = [wait(h) for h in handles]
    got["late"] = wait(late[0])
    child = late[1].result(60)
    snap = late[2].result(60)
    assert child is not None and snap is not None
    got["child"] = wait(child.generate_async([5], greedy(6)))
    got["export"] = snap
    got["positions"] = [x.position for x in s]
    for x in (*s, child):
        x.close()
    return got


def stop_and_follow_up(runner: Runner, ex: ModuleExecutor, seen: dict, stop: int | None) -> dict:
    """A generation ending at a stop token (or max_new_tokens), then a second turn in the same session
    and one in a session that decoded beside it and was closed right after a step."""
    a, b = runner.open_session(), runner.open_session()
    config = greedy(16, stop_tokens=(stop,)) if stop is not None else greedy(16)
    ha = a.generate_async(PROMPTS[0], config)
    closed: list = []

    def close_b(update) -> None:
        closed.extend(update.tokens)
        if update.tokens and len(closed) >= 3 and "pending_at_close" not in seen:
            seen["pending_at_close"] = ex._lookahead.pending is not None
            b.close()  # queued from the engine thread: runs before the next forward

    hb = b.generate_async(PROMPTS[1], greedy(10), close_b)
    first = wait(ha)
    b_result = hb.wait(60)
    second = wait(a.generate_async([40, 41, 42], SAMPLED))
    got = {"first": first, "b": (tuple(b_result.tokens), str(b_result.finish_reason)), "second": second,
           "position": a.position}  # fmt: skip
    a.close()
    return got


def run_both(model, kind: str, scenario, *args) -> tuple[dict, dict, ModuleExecutor, dict]:
    """The scenario with lookahead off, then on: (off's results, on's, on's executor, what on saw)."""
    out, seen = {}, {}
    for on in (False, True):
        runner, ex = make_runner(model, kind, on)
        seen = {}
        try:
            out[on] = (scenario(runner, ex, seen, *args), ex)
        finally:
            runner.shutdown()
    assert out[True][1].lookahead and not out[False][1].lookahead
    return out[False][0], out[True][0], out[True][1], seen


def readable_slots(rows: int, written: int, ring: bool) -> np.ndarray:
    """Rows of an exported array to compare: all, but a wrapped ring's slot of position written - slots
    (its spare: a discarded lookahead row may have overwritten it; no position from the floor on reads it)."""
    keep = np.ones(rows, dtype=bool)
    if ring and written > rows:
        keep[(written - rows) % rows] = False
    return keep


def assert_same(off: dict, on: dict, rings: frozenset[str] = frozenset()) -> None:
    """``rings``: the exported arrays of sliding-window layers (their spare slot is not compared)."""
    for key in off:
        if key == "export":
            a, b = off[key], on[key]
            assert (a.content, a.state.length, a.state.written) == (
                b.content,
                b.state.length,
                b.state.written,
            )
            assert a.state.arrays.keys() == b.state.arrays.keys()
            for name in a.state.arrays:
                x, y = np.array(a.state.arrays[name]), np.array(b.state.arrays[name])
                keep = readable_slots(x.shape[1], a.state.written, name in rings)
                np.testing.assert_array_equal(x[:, keep], y[:, keep])
        else:
            assert off[key] == on[key], key


WEIGHTS = ("float32", "q8_0") if kernels() is not None else ("float32",)


@pytest.mark.parametrize("kind,layers", SETUPS)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_join_leave_clone_export_match_lookahead_off(tiny_model, kind, layers, weights) -> None:
    model = tiny_model(layers, window=4, tie_embeddings=False, weights_dtype=weights)
    off, on, ex, seen = run_both(model, kind, join_and_leave)
    assert len(set(off["outs"][0][0])) > 2 and len(set(off["outs"][1][0])) > 2  # varied streams
    rings = frozenset(f"layers.{i}.{a}" for i, c in enumerate(layers) if c == "R" for a in ("keys", "values"))
    assert_same(off, on, rings if kind == "batched-sequence" else frozenset())
    assert ex.lookahead_used > 5 and ex.lookahead_discarded > 0 and seen["pending_at_clone"]


@pytest.mark.parametrize("kind,layers", SETUPS)
@pytest.mark.parametrize("use_stop", [False, True])
def test_stop_max_tokens_and_follow_up_match_lookahead_off(tiny_model, kind, layers, use_stop) -> None:
    model = tiny_model(layers, window=4, tie_embeddings=False)
    stop = None
    if use_stop:  # a token the greedy stream reaches a few steps in
        runner, _ = make_runner(model, kind, False)
        try:
            with runner.open_session() as session:
                stream = wait(session.generate_async(PROMPTS[0], greedy(16)))[0]
        finally:
            runner.shutdown()
        stop = stream[5]
    off, on, ex, seen = run_both(model, kind, stop_and_follow_up, stop)
    assert_same(off, on)
    assert seen["pending_at_close"]
    if use_stop:
        assert off["first"][0][-1] == stop and len(off["first"][0]) < 16
    assert ex.lookahead_used > 3


def test_rings_keep_it(tiny_model) -> None:
    """batched-sequence over sliding layers: a discarded row is taken back through the spare slot."""
    ex = ModuleExecutor.create(tiny_model("FRFR", window=4), "batched-sequence", max_sessions=2,
                               max_session_tokens=32)  # fmt: skip
    assert ex.lookahead


# --- executor level: the changed token, the position, and the negative controls -------------------


def decode_loop(ex: ModuleExecutor, sids: list[int], n: int, force: dict | None = None) -> list[list[int]]:
    """Prefill each session, then decode them together n steps, tracking positions without asking the
    executor (a position query settles the lookahead). ``force``: {step: token} fed to the first
    session instead of its prediction at that step (a caller overriding the pending token)."""
    outs = ex.execute([ExecInput(sid, 0, tokens=tuple(PROMPTS[i])) for i, sid in enumerate(sids)])
    toks = [list(o.tokens) for o in outs]
    pos = [len(PROMPTS[i]) for i in range(len(sids))]
    for step in range(n):
        feed = [t[-1] for t in toks]
        if force and step in force:
            feed[0] = force[step]
        outs = ex.execute([ExecInput(sid, pos[i], tokens=(feed[i],)) for i, sid in enumerate(sids)])
        for i, o in enumerate(outs):
            assert o.error is None, o.error
            toks[i].extend(o.tokens)
            pos[i] += 1
    return toks


def executor_run(model, lookahead: bool, force: dict | None = None) -> tuple[list[list[int]], ModuleExecutor]:
    ex = ModuleExecutor.create(model, "batched-cell", max_sessions=4, max_session_tokens=64,
                               lookahead=lookahead)  # fmt: skip
    sids = [ex.open_session() for _ in range(3)]
    ex.set_sampling(sids[1], SamplingParams(temperature=0.9, top_k=40), seed=3)
    toks = decode_loop(ex, sids, 10, force)
    return toks, ex


def test_a_changed_input_token_and_the_position_match_lookahead_off(tiny_model) -> None:
    model = tiny_model("FRFR", window=4, tie_embeddings=False)
    force = {4: 11, 5: 12}
    want, _ = executor_run(model, False, force)
    got, ex = executor_run(model, True, force)
    assert got == want
    assert ex.lookahead_used > 0 and ex.lookahead_discarded >= 2
    sid = next(iter(ex._sessions))
    # the queued row is discarded before a position query: the committed position, not one past it
    assert ex.position(sid) == len(PROMPTS[0]) + 10


def break_key_restore(monkeypatch) -> None:
    monkeypatch.setattr("engine_service.executors.sampling.Sampler.restore_key", lambda self, key: None)


def break_token_check(monkeypatch) -> None:
    original = Lookahead._continues

    def continues(self, ahead, batch):
        real = ahead.tokens
        ahead.tokens = mx.array([inp.tokens[0] if inp.tokens else -1 for inp in batch], dtype=mx.int32)
        try:
            return original(self, ahead, batch)
        finally:
            ahead.tokens = real

    monkeypatch.setattr(Lookahead, "_continues", continues)


@pytest.mark.parametrize("breakage", [break_key_restore, break_token_check])
def test_a_wrong_lookahead_is_caught(tiny_model, monkeypatch, breakage) -> None:
    """Negative control: the comparison above fails for a lookahead that keeps the advanced keys of a
    discarded draw, or that reuses its step although the caller fed another token."""
    model = tiny_model("FRFR", window=4, tie_embeddings=False)
    force = {4: 11, 5: 12}
    want, _ = executor_run(model, False, force)
    breakage(monkeypatch)
    got, _ = executor_run(model, True, force)
    assert got != want


def test_a_lookahead_leaving_its_high_water_mark_is_caught(tiny_model, monkeypatch) -> None:
    """Negative control for the export comparison: a discard that only rewinds the length leaves the
    extra row in ``written``, which the exported snapshot shows."""
    monkeypatch.setattr(SequenceCache, "take_back", lambda self, start, written: self.rewind(start))
    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    off, on, _, _ = run_both(model, "batched-sequence", join_and_leave)
    assert off["outs"] == on["outs"]
    with pytest.raises(AssertionError):
        assert_same(off, on)


def rotate(runner: Runner, ex: ModuleExecutor, seen: dict) -> dict:
    """Six sessions decoding through a runner that takes four a batch: the batches rotate."""
    sessions = [runner.open_session() for _ in range(6)]
    handles = [s.generate_async([3 + i, 5, 7], greedy(20)) for i, s in enumerate(sessions)]
    got = {"outs": [wait(h) for h in handles]}
    for s in sessions:
        s.close()
    return got


def test_rotating_batches_match_and_waste_no_forwards(tiny_model, monkeypatch) -> None:
    """Batches that rotate through more sessions than one takes would discard every queued step (a
    forward computed for nothing); a step is queued only after a batch repeated the one before. The
    control: queuing after every plain decode round discards most of them."""
    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    off, on, ex, _ = run_both(model, "batched-sequence", rotate)
    assert_same(off, on)
    assert ex.lookahead_discarded <= 6  # at most one per generation's end
    monkeypatch.setattr(ModuleExecutor, "execute", _execute_always_repeated(ModuleExecutor.execute))
    _, always, eager, _ = run_both(model, "batched-sequence", rotate)
    assert always == off  # still correct, only wasteful
    assert eager.lookahead_discarded > 3 * max(1, ex.lookahead_discarded)


def _execute_always_repeated(execute):
    def run(self, batch):
        self._lookahead._batch_sids = tuple(inp.sid for inp in batch)  # every batch looks like a repeat
        return execute(self, batch)

    return run


def buffer_addresses(ex: ModuleExecutor, sid: int, steps: int, hold: list | None = None) -> list[int]:
    """The address of session ``sid``'s layer-0 key buffer after each of ``steps`` decode steps (the
    lookahead queues the next step inside each call). ``hold``: a list the buffers are appended to,
    so a Python name keeps each one alive (the negative control)."""

    def address() -> int:
        keys = ex.cache.sequence(ex._sessions.state(sid).seq).buffers(0)[0]
        if hold is not None:
            hold.append(keys)
        return np.asarray(memoryview(keys)).__array_interface__["data"][0]

    out = ex.execute([ExecInput(sid, 0, tokens=tuple(PROMPTS[0]))])
    token, pos, seen = out[0].tokens[-1], len(PROMPTS[0]), []
    for _ in range(steps):
        (out,) = ex.execute([ExecInput(sid, pos, tokens=(token,))])
        token, pos = out.tokens[-1], pos + 1
        seen.append(address())
    return seen


@pytest.mark.skipif(kernels() is None, reason="compiled kernels not built (scripts/setup.sh)")
def test_queued_steps_write_their_rows_in_place(tiny_model) -> None:
    """With the lookahead the next step's K/V write runs while this step is still referenced; nothing
    of this step may hold its buffers then, or ``kv_store`` copies every buffer each step (it did: the
    round kept its arrays in a list while the next step was queued). In place, the buffer stays put;
    the negative control holds each buffer in a list, and the writes must copy (new addresses)."""
    model = tiny_model("FFFF", window=4, tie_embeddings=False)
    ex = ModuleExecutor.create(
        model, "batched-sequence", max_sessions=2, max_session_tokens=64, lookahead=True
    )
    assert ex.cache._cfg.kv_store is not None
    seen = buffer_addresses(ex, ex.open_session(), 8)
    assert ex.lookahead_used >= 6
    assert len(set(seen)) == 1, seen
    held: list = []
    ex2 = ModuleExecutor.create(
        model, "batched-sequence", max_sessions=2, max_session_tokens=64, lookahead=True
    )
    assert len(set(buffer_addresses(ex2, ex2.open_session(), 8, held))) > 1
