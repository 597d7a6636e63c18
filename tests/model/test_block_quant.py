"""Block-quantized weights (q8_0 / q4_1) in the model: conversions, and a model on them equals the
float32 model built from exactly the values they hold (float activations: only rounding differs)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.model.block_quant import (
    BlockQuantTensor,
    concat_block_rows,
    natural_block_format,
    to_q4_1,
    to_q8_0,
)
from engine_service.model.random_init import random_tensors, tiny_config
from engine_service.model.transformer import Transformer
from engine_service.model.weights import QuantTensor
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
    assert both.shape == (80, 100) and np.array_equal(np.array(both.dequantize())[40:], np.array(q8.dequantize()))


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


def test_natural_format_keeps_4bit_sources_as_q4_1():
    w = mx.random.normal((64, 64), key=mx.random.key(2))
    q4 = QuantTensor(*mx.quantize(w, group_size=32, bits=4), 32, 4)
    q8 = QuantTensor(*mx.quantize(w, group_size=32, bits=8), 32, 8)
    assert natural_block_format({"embed": q8, "layers.0.q": q4}) == "q4_1"
    assert natural_block_format({"embed": q8, "layers.0.q": q8}) == "q8_0"
    assert natural_block_format({"layers.0.q": w}) == "q8_0"
