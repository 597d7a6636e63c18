"""The packaged SmolLM2-135M-Instruct GGUF, end to end (slow: loads ~100 MB of weights)."""

from __future__ import annotations

import pytest

from engine_service.greedy import greedy_tokens, new_cache
from engine_service.model import load_model


@pytest.mark.slow
# auto: q4_1 on the CPU with the compiled kernels (float32 without); quantized: MLX's Q4_1 kept as is
@pytest.mark.parametrize("weights_dtype", ["auto", "float32", "quantized", "q8_0", "q4_1"])
def test_greedy_answer_names_paris(weights_dtype):
    loaded = load_model(None, weights_dtype)  # the packaged GGUF
    tok = loaded.tokenizer
    prompt = tok.encode(loaded.chat.format([{"role": "user", "content": "What is the capital of France?"}]))
    cache = new_cache(loaded.model, len(prompt) + 12)
    ids = list(greedy_tokens(loaded.model, cache, cache.seq_new(), prompt, 12, tok.eos_token_ids))
    text = tok.decode(ids, skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_block_formats_logits_close_to_float32():
    """q4_1 holds the GGUF's Q4_1 weights exactly: only float32 rounding order differs (observed 6e-5 on
    logits ~25; bound 1e-3). q8_0 requantizes those 4-bit weights (half a step of amax/127 a weight):
    observed ~0.95, bound 2.0, and float32's top token among q8_0's top 3."""
    import mlx.core as mx
    import numpy as np

    from engine_service.greedy import prefill

    logits = {}
    for dtype in ("float32", "q4_1", "q8_0"):
        loaded = load_model(None, dtype)
        prompt = loaded.tokenizer.encode(
            loaded.chat.format([{"role": "user", "content": "Name three primary colors."}])
        )
        cache = new_cache(loaded.model, len(prompt) + 1)
        out = prefill(loaded.model, cache, cache.seq_new(), prompt)
        mx.eval(out)
        logits[dtype] = np.array(out)
    ref = logits["float32"]
    assert np.abs(logits["q4_1"] - ref).max() < 1e-3
    assert np.abs(logits["q8_0"] - ref).max() < 2.0
    assert np.argmax(ref) in np.argsort(logits["q8_0"])[-3:]
