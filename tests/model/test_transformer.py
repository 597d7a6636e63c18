"""The transformer against independent references: a naive numpy forward, cold recompute, separate runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.cache.batch_control import Segment
from engine_service.model.formats.weights import QuantTensor
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.model.transformer import Transformer
from tests.model import naive_reference
from tests.model.gguf_writer import permute_for_gguf
from tests.model.reference_cache import ReferenceCache, run

TOKENS = [5, 17, 99, 3, 42, 42, 7, 120, 64, 1, 33, 8, 91, 27]  # 14 > window 4: crosses the window


def close(a, b, atol=1e-4) -> bool:
    return np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), atol=atol, rtol=1e-4)


def cold(model, tokens):
    cache = ReferenceCache(model.config.layers)
    return run(model, cache, [(cache.seq_new(), 0, tokens)], all_rows=True)[0]


@pytest.mark.parametrize(
    "layers,traditional,tied", [("FR", False, True), ("RF", True, False), ("FRSF", False, True)]
)
def test_matches_naive_numpy_forward(layers, traditional, tied):
    config = tiny_config(layers, 3, rope_traditional=traditional, tie_embeddings=tied)
    tensors = random_tensors(config, seed=3)
    model = Transformer(config, tensors)
    want = naive_reference.forward(config, tensors, TOKENS)
    got = cold(model, TOKENS)
    assert close(got, want), np.abs(np.asarray(got) - want).max()


def test_naive_reference_notices_a_wrong_window():
    """Negative control: the numpy reference must disagree with a model whose sliding layer is full."""
    config = tiny_config("FR", 3)
    tensors = random_tensors(config, seed=3)
    full = Transformer(tiny_config("FF", 3), tensors)
    assert not close(cold(full, TOKENS), naive_reference.forward(config, tensors, TOKENS))


def _permute_for_gguf(w: mx.array, heads: int) -> mx.array:
    return mx.array(permute_for_gguf(np.asarray(w), heads))


def test_traditional_rope_on_permuted_rows_equals_default_rope():
    """The GGUF convention: permuted Q/K rows + traditional RoPE == original rows + half-split RoPE."""
    hf = tiny_config("FR", 4)
    tensors = random_tensors(hf, seed=5)
    gguf_tensors = dict(tensors)
    for i in range(hf.num_layers):
        gguf_tensors[f"layers.{i}.q"] = _permute_for_gguf(tensors[f"layers.{i}.q"], hf.num_heads)
        gguf_tensors[f"layers.{i}.k"] = _permute_for_gguf(tensors[f"layers.{i}.k"], hf.num_kv_heads)
    want = cold(Transformer(hf, tensors), TOKENS)
    assert close(cold(Transformer(tiny_config("FR", 4, rope_traditional=True), gguf_tensors), TOKENS), want)
    # and the wrong convention on the permuted rows does not
    assert not close(cold(Transformer(hf, gguf_tensors), TOKENS), want)


@pytest.mark.parametrize("layers", ["FRFR", "RRRR", "FFFF"])
def test_token_by_token_decode_equals_full_recompute(tiny_model, layers):
    model = tiny_model(layers, window=4, seed=1)
    want = cold(model, TOKENS)
    cache = ReferenceCache(model.config.layers)
    seq = cache.seq_new()
    got = [run(model, cache, [(seq, p, [tok])])[0] for p, tok in enumerate(TOKENS)]
    assert close(mx.stack(got), want)


def test_chunked_prefill_equals_full_recompute(tiny_model):
    model = tiny_model("FRFR", window=4)
    want = cold(model, TOKENS)
    cache = ReferenceCache(model.config.layers)
    seq = cache.seq_new()
    parts = [
        run(model, cache, [(seq, a, TOKENS[a:b])], all_rows=True)[0] for a, b in ((0, 5), (5, 6), (6, 14))
    ]
    assert close(mx.concatenate(parts), want)


def test_broken_window_is_detected(tiny_model):
    """Negative control: a cache that ignores the sliding window diverges once the window is crossed."""
    model = tiny_model("FRFR", window=4)
    cache = ReferenceCache(model.config.layers, ignore_window=True)
    got = run(model, cache, [(cache.seq_new(), 0, TOKENS)], all_rows=True)[0]
    want = cold(model, TOKENS)
    assert close(got[:4], want[:4])  # within the window nothing differs
    assert not close(got[4:], want[4:])


def test_packed_multi_sequence_forward_equals_separate_forwards(tiny_model):
    model = tiny_model("FRFR", window=4, seed=2)
    histories = {0: TOKENS[:7], 1: [], 2: TOKENS[3:12]}
    new = {0: [11, 12, 13], 1: [50, 51, 52, 53, 54, 55], 2: [9]}
    separate = {}
    for key in histories:
        separate[key] = cold(model, histories[key] + new[key])[len(histories[key]) :]

    cache = ReferenceCache(model.config.layers)
    seqs = {key: cache.seq_new() for key in histories}
    for key, hist in histories.items():
        if hist:
            run(model, cache, [(seqs[key], 0, hist)])
    packed = run(model, cache, [(seqs[k], len(histories[k]), new[k]) for k in (2, 0, 1)], all_rows=True)
    for got, key in zip(packed, (2, 0, 1), strict=True):
        assert close(got, separate[key]), key


def test_logit_rows_and_embeddings_inputs(tiny_model):
    model = tiny_model("FR", window=4)
    tokens = mx.array(TOKENS, dtype=mx.int32)
    positions = mx.arange(len(TOKENS), dtype=mx.int32)
    cache = ReferenceCache(model.config.layers)
    full = model(cache.begin_step([Segment(cache.seq_new(), 0, len(TOKENS))]), positions, tokens=tokens)
    rows = mx.array([13, 0, 6], dtype=mx.int32)
    cache = ReferenceCache(model.config.layers)
    picked = model(
        cache.begin_step([Segment(cache.seq_new(), 0, len(TOKENS))]),
        positions,
        embeddings=model.embed(tokens),
        logit_rows=rows,
    )
    assert picked.shape == (3, model.config.vocab_size) and picked.dtype == mx.float32
    assert close(picked, full[rows])


def test_bad_calls_raise(tiny_model):
    model = tiny_model("F")
    cache = ReferenceCache(model.config.layers)
    step = cache.begin_step([Segment(cache.seq_new(), 0, 2)])
    toks = mx.array([1, 2], dtype=mx.int32)
    with pytest.raises(ValueError, match="exactly one"):
        model(step, mx.array([0, 1]), tokens=toks, embeddings=model.embed(toks))
    with pytest.raises(ValueError, match="positions"):
        model(step, mx.array([0, 1, 2]), tokens=toks)


def test_quantized_weights_match_their_dequantized_float_model():
    config = tiny_config("FR", 4)
    tensors = random_tensors(config, seed=4)
    quant = Transformer(config, tensors, "quantized")
    assert quant.layers[0].qkv.quantized
    # the float model built from exactly the values the quantized model holds
    dequant = {}
    for name, value in tensors.items():
        if value.ndim == 2:
            w, s, b = mx.quantize(value, group_size=32, bits=4)
            dequant[name] = QuantTensor(w, s, b, 32, 4).dequantize()
        else:
            dequant[name] = value
    want = cold(Transformer(config, dequant), TOKENS)
    assert close(cold(quant, TOKENS), want, atol=1e-3)
    assert not close(cold(Transformer(config, tensors), TOKENS), want, atol=1e-3)  # quantization is visible


@pytest.mark.parametrize("dtype,atol", [("float16", 0.1), ("bfloat16", 0.5)])  # 11 vs 8 mantissa bits
def test_half_precision_weights_keep_float32_activations(tiny_model, dtype, atol):
    model = tiny_model("FR", weights_dtype=dtype)
    assert model.layers[0].qkv.weight.dtype == getattr(mx, dtype)
    out = cold(model, TOKENS)
    assert out.dtype == mx.float32
    assert close(out, cold(tiny_model("FR"), TOKENS), atol=atol)


def test_quantized_prefill_block_equals_quantized_decode(tiny_model):
    """A long block (dequantize + BLAS on the CPU) and row-by-row decode (quantized matmul) agree."""
    model = tiny_model("FRFR", window=4, weights_dtype="quantized")
    tokens = TOKENS + TOKENS[:8]  # 22 rows: above the dequantize threshold
    want = cold(model, tokens)
    cache = ReferenceCache(model.config.layers)
    seq = cache.seq_new()
    got = [run(model, cache, [(seq, p, [tok])])[0] for p, tok in enumerate(tokens)]
    assert close(mx.stack(got), want, atol=1e-3)
