"""The packaged SmolLM2-135M-Instruct GGUF, end to end (slow: loads ~100 MB of weights)."""

from __future__ import annotations

import pytest

from engine_service.greedy import greedy_tokens, new_cache
from engine_service.model import load_model


@pytest.mark.slow
@pytest.mark.parametrize("weights_dtype", ["auto", "quantized"])  # auto: float32 on the CPU; Q4_1 kept as is
def test_greedy_answer_names_paris(weights_dtype):
    loaded = load_model(None, weights_dtype)  # the packaged GGUF
    tok = loaded.tokenizer
    prompt = tok.encode(loaded.chat.format([{"role": "user", "content": "What is the capital of France?"}]))
    cache = new_cache(loaded.model, len(prompt) + 12)
    ids = list(greedy_tokens(loaded.model, cache, cache.seq_new(), prompt, 12, tok.eos_token_ids))
    text = tok.decode(ids, skip_special_tokens=True)
    assert "Paris" in text, text
