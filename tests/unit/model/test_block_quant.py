"""Block-quantized weights (q8_0 / q4_1) in the model: conversions, and a model on them equals the
float32 model built from exactly the values they hold (float activations: only rounding differs)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.model.formats.block_quant import (
    BlockQuantTensor,
    concat_block_rows,
    to_q4_1,
    to_q8_0,
)
from engine_service.model.formats.weights import QuantTensor
from engine_service.model.projections import NATIVE, convert, native_format
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.model.transformer import Transformer
from tests.model.test_transformer import TOKENS, close, cold


def test_q4_1_from_mlx_4bit_is_lossless_and_q8_0_within_half_a_step():
    w = mx.random.normal((40, 100), key=mx.random.key(1))
    q4 = QuantTensor(*mx.quantize(w[:, :96], group_size=32, bits=4), 32, 4)
    assert np.array_equal(np.array(to_q4_1(q4).dequantize()), np.array(q4.dequantize()))
    q8 = to_q8_0(w)  # K = 100: padded to 128
    assert q8.wq.shape == (40, 128) and q8.shape == (40, 100)
    step = np.repeat(np.array(q8.scales), 32, axis=1)[:, :100]
    assert np.all(np.abs(np.array(q8.dequantize()) - np.array(w)) <= step / 2 + 1e-7)
    ids = mx.array([3, 0, 39])
    assert np.array_equal(np.array(q8.rows(ids)), np.array(q8.dequantize())[[3, 0, 39]])
    both = concat_block_rows([q8, q8])
    assert both.shape == (80, 100) and np.array_equal(
        np.array(both.dequantize())[40:], np.array(q8.dequantize())
    )


def test_block_tensor_checks_its_arrays():
    with pytest.raises(ValueError, match="format"):
        BlockQuantTensor("q5", mx.zeros((2, 32), mx.int8), mx.zeros((2, 1)), None, 32)
    with pytest.raises(ValueError, match="in_features"):
        BlockQuantTensor("q8_0", mx.zeros((2, 32), mx.int8), mx.zeros((2, 1)), None, 40)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_model_on_block_weights_equals_float_model_of_their_values(fmt):
    config = tiny_config("FR", 4, tie_embeddings=False)
    tensors = random_tensors(config, seed=4)
    quant = Transformer(config, tensors, fmt)
    assert quant.layers[0].qkv.block and quant.layers[0].qkv.tensor.format == fmt
    assert quant.lm_head.tensor.format == "q8_0"  # the head stays 8-bit under q4_1
    convert = {"q8_0": to_q8_0, "q4_1": to_q4_1}
    dequant = {}
    for name, value in tensors.items():
        head = name in ("embed", "lm_head")
        dequant[name] = convert["q8_0" if head else fmt](value).dequantize() if value.ndim == 2 else value
    want = cold(Transformer(config, dequant), TOKENS)
    assert close(cold(quant, TOKENS), want, atol=1e-4)
    assert not close(cold(Transformer(config, tensors), TOKENS), want, atol=1e-4)  # quantization is visible


def test_native_format_keeps_each_source_lossless():
    w = mx.random.normal((64, 64), key=mx.random.key(2))
    q4 = QuantTensor(*mx.quantize(w, group_size=32, bits=4), 32, 4)
    q8 = QuantTensor(*mx.quantize(w, group_size=32, bits=8), 32, 8)
    assert native_format(q4) == "q4_1" and native_format(to_q4_1(w)) == "q4_1"
    assert native_format(q8) == "q8_0" and native_format(w) == "q8_0"
    kept = convert(to_q4_1(w), NATIVE)
    assert kept.format == "q4_1" and np.array_equal(
        np.array(kept.dequantize()), np.array(to_q4_1(w).dequantize())
    )
    assert convert(q4, NATIVE).format == "q4_1"
    assert np.array_equal(np.array(convert(q4, NATIVE).dequantize()), np.array(q4.dequantize()))
    # a forced format that differs from the source requantizes (visible): q4_1 values into q8_0
    forced = convert(to_q4_1(w), "q8_0")
    assert forced.format == "q8_0"
    assert not np.array_equal(np.array(forced.dequantize()), np.array(to_q4_1(w).dequantize()))


def test_native_model_reports_the_formats_its_matrices_kept():
    config = tiny_config("FR", 4)
    tensors = random_tensors(config, seed=4)
    mixed = dict(tensors)
    for i in range(2):
        for name in ("q", "k", "o", "gate", "up"):
            mixed[f"layers.{i}.{name}"] = to_q4_1(tensors[f"layers.{i}.{name}"])
    model = Transformer(config, mixed, NATIVE)
    assert model.weights_dtype == "q4_1+q8_0"
    # q/k kept q4_1 and v became q8_0: one projection per format, outputs concatenated in order
    assert [p.format for p in model.layers[0].qkv.parts] == ["q4_1", "q4_1", "q8_0"]
    assert (
        Transformer(
            config, {**tensors, **{k: to_q4_1(v) for k, v in tensors.items() if v.ndim == 2}}, NATIVE
        ).weights_dtype
        == "q4_1"
    )
