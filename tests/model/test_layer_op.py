"""A fused layer as one op (``forkline_kernels.DecoderLayer``, ``layers.LAYER_OP``) against the same
layer as five fused ops over the step's views: bitwise equal logits on every layer shape the fused path
covers, through a prefill, a clone that reads its source's shared rows, batched steps of three sessions
and decode past the sliding window (rings), float32 and float16 K/V. The op is what runs (its calls
counted, a shared piece among their parts); negative control: an op that reads one row fewer of a
buffer is caught by the same comparison."""

from __future__ import annotations

import numpy as np
import pytest

import engine_service.cache.batched_sequence as batched_sequence
import engine_service.model.layers as layers
from engine_service.executors.base import ExecInput
from engine_service.executors.module import ModuleExecutor
from engine_service.model.cpu_kernels import kernels
from engine_service.model.random_init import random_model
from tests.model.test_fused_layers import MODELS, PROMPT

ext = kernels()
if ext is None or getattr(ext, "DecoderLayer", None) is None:
    pytest.skip(
        "compiled kernels with DecoderLayer are not built (scripts/setup.sh)", allow_module_level=True
    )


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return random_model("FRFR", 6, 2, **MODELS[request.param])


def run(model, layer_op: bool, kv_dtype: str, cache_kind: str = "batched-sequence") -> np.ndarray:
    """A prompt; a clone of its first 8 positions and a new session join it in one batched step; then
    6 greedy steps of all three (past the window of 6): every output's logits, concatenated."""
    old = layers.LAYER_OP
    layers.LAYER_OP = layer_op
    try:
        # forwards of at most 4 rows: a sliding layer's ring holds window + 3 slots, so it wraps
        ex = ModuleExecutor.create(
            model, cache_kind, 4, 64, kv_dtype=kv_dtype, keep_logits=True, prefill_chunk=4
        )
        a = ex.open_session()
        rows = []
        out = ex.execute([ExecInput(a, 0, tokens=tuple(PROMPT[:12]))])[0]
        rows.append(np.array(out.logits))
        b, c = ex.clone(a, 8), ex.open_session()
        batch = [
            ExecInput(a, 12, tokens=(out.tokens[-1],)),
            ExecInput(b, 8, tokens=(3, 9, 27, 81)),
            ExecInput(c, 0, tokens=tuple(PROMPT[5:15])),
        ]
        at = {a: 13, b: 12, c: 10}
        for _ in range(7):
            outs = ex.execute(batch)
            rows.extend(np.array(o.logits) for o in outs)
            batch = [ExecInput(o.sid, at[o.sid], tokens=(o.tokens[-1],)) for o in outs]
            at = {sid: n + 1 for sid, n in at.items()}
        return np.concatenate([r.reshape(-1) for r in rows])
    finally:
        layers.LAYER_OP = old


@pytest.fixture
def calls(model, monkeypatch):
    """Each layer op call's parts (the layers gather their fused-op arguments again, with the spy)."""
    seen = []
    original = ext.DecoderLayer

    def spy(*args, **kwargs):
        layer = original(*args, **kwargs)

        def call(*call_args):
            seen.append(call_args[7])
            return layer(*call_args)

        return call

    monkeypatch.setattr(ext, "DecoderLayer", spy)
    for layer in model.layers:
        object.__setattr__(layer, "_calls", None)
    yield seen
    for layer in model.layers:
        object.__setattr__(layer, "_calls", None)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_one_op_a_layer_equals_the_fused_ops(model, kv_dtype, calls):
    want = run(model, False, kv_dtype)
    assert not calls
    got = run(model, True, kv_dtype)
    assert np.array_equal(got, want), np.abs(got - want).max()
    # every layer of every forward ran as one op, some over a piece shared with the clone's source,
    # some over a ring (its slots' positions out of order)
    assert len(calls) % len(model.layers) == 0 and len(calls) >= 8 * len(model.layers)
    assert any(part[0] < 0 for parts in calls for part in parts)
    assert any(np.any(np.diff(np.array(part[5])) < 0) for parts in calls for part in parts)


def test_one_op_a_layer_over_the_cell_pool(model, calls):
    """batched-cell: each segment reads its span or runs of the shared pool as parts of one buffer."""
    want = run(model, False, "float16", "batched-cell")
    got = run(model, True, "float16", "batched-cell")
    assert np.array_equal(got, want), np.abs(got - want).max()
    assert len(calls) >= 8 * len(model.layers)
    assert any(part[1] > 0 for parts in calls for part in parts)  # a part inside the pool


def test_the_comparison_can_fail(model, monkeypatch):
    want = run(model, False, "float32")
    original = batched_sequence.SequenceStep.layer_io

    def short(self, layer):
        io = original(self, layer)
        seg, start, rows, keys, values, positions = io.parts[-1]
        if rows > 1:
            io.parts[-1] = (seg, start, rows - 1, keys, values, positions[: rows - 1])
        return io

    monkeypatch.setattr(batched_sequence.SequenceStep, "layer_io", short)
    got = run(model, True, "float32")
    assert not np.array_equal(got, want)
