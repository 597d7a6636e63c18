"""Perplexity of the packaged model's block formats against float32 on a fixed text (issue 13 item 4).

The packaged GGUF is Q4_1: ``float32`` dequantizes it, ``q4_1`` keeps those exact weights (only float32
rounding order differs), ``q8_0`` requantizes them to 8 bits. Bounds from the issue: q8_0 within 1%,
the 4-bit format within 5% of float32's perplexity. Each text is scored two ways: one forward over
all of it (on AVX2 blocks above 64 rows go through the panel GEMM), and 64-row chunks (every row
through the compiled kernels, the decode / prefix-hit path). Measured (364 tokens): float32 21.868,
q8_0 22.022 (+0.71%), q4_1 21.868 (+0.000%: the source's own 4-bit weights; no float original ships).
"""

from __future__ import annotations

import math

import pytest

TEXT = (
    "The river starts as a thin stream high in the hills, where snow melts slowly through the spring. "
    "By the time it reaches the valley it is wide enough for small boats, and the town that grew up on "
    "its banks has depended on it for centuries. Farmers once brought grain to the mill by the bridge, "
    "and the miller kept careful records of every sack he ground. Those records, written in a neat hand "
    "in thick leather books, are now kept in the town library, where anyone may read them on a quiet "
    "afternoon. They show which years were dry and which were wet, when the price of bread rose, and how "
    "often the bridge had to be repaired after a flood.\n\n"
    "Today the mill is a small museum. Visitors can watch the great wooden wheel turn and learn how the "
    "stones were dressed by hand so that the flour came out fine and even. A volunteer explains that the "
    "work was hard and the hours were long, but that the mill was also a place where people met, traded "
    "news and settled arguments. Children are usually most interested in the cats, which were kept to "
    "chase away the mice, and in the heavy iron keys that locked the doors at night.\n\n"
    "In the evening the light on the water turns gold, and people walk along the path beside the river. "
    "Some of them fish, some read on the benches, and some simply watch the ducks move slowly against "
    "the current. The town has changed a great deal over the years, with new houses, shops and a "
    "railway station, but the river still sets the rhythm of daily life. When the water is high in "
    "spring, everyone talks about the weather; when it is low in late summer, they talk about rain. "
    "It is, as one old resident likes to say, the oldest neighbour anyone in the town has ever had."
)
BOUNDS = {"q8_0": 0.01, "q4_1": 0.05}


def _perplexity(loaded, ids: list[int], chunk: int, kv_dtype: str = "float32") -> float:
    """exp(mean negative log-likelihood of ids[1:]), every row's logits from forwards of ``chunk`` rows."""
    import mlx.core as mx

    from engine_service.cache.batch_control import Segment
    from engine_service.greedy import new_cache

    model = loaded.model
    cache = new_cache(model, len(ids), prefill_chunk=chunk, kv_dtype=kv_dtype)
    seq = cache.seq_new()
    nll = 0.0
    for a in range(0, len(ids) - 1, chunk):
        piece = ids[a : a + chunk]
        step = cache.begin_step([Segment(seq, a, len(piece))])
        logits = model(
            step,
            mx.arange(a, a + len(piece), dtype=mx.int32),
            tokens=mx.array(piece, dtype=mx.int32),
            logit_rows=mx.arange(len(piece), dtype=mx.int32),
        ).astype(mx.float32)
        targets = ids[a + 1 : a + 1 + len(piece)]  # the last chunk's final row has no next token
        logits = logits[: len(targets)]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, mx.array(targets, dtype=mx.int32)[:, None], axis=-1)
        total = -mx.sum(picked)
        mx.eval(total, step.state())
        nll += total.item()
    return math.exp(nll / (len(ids) - 1))


@pytest.mark.slow
def test_block_formats_perplexity_close_to_float32():
    from engine_service.model import load_model

    ppl: dict[tuple[str, int], float] = {}
    ids: list[int] = []
    for dtype in ("float32", "q8_0", "q4_1"):
        loaded = load_model(None, dtype)
        ids = loaded.tokenizer.encode(TEXT)
        assert 300 <= len(ids) <= 512, len(ids)
        for chunk in (len(ids), 64):
            ppl[dtype, chunk] = _perplexity(loaded, ids, chunk)
    ref = ppl["float32", len(ids)]
    report = ", ".join(f"{d} chunk {c}: {p:.4f}" for (d, c), p in ppl.items())
    print(f"\nperplexity over {len(ids)} tokens: {report}")
    assert 1.5 < ref < 60, report  # a sane model on plain prose (a broken forward gives ~vocab size)
    assert abs(ppl["float32", 64] / ref - 1) < 1e-3, report  # chunking itself changes nothing
    for dtype, bound in BOUNDS.items():
        for chunk in (len(ids), 64):
            assert abs(ppl[dtype, chunk] / ref - 1) < bound, report


@pytest.mark.slow
def test_gemma3_auto_formats_perplexity_within_half_a_percent_of_the_files_values():
    """Gemma 3's Q4_K_M file: auto keeps Q4_K as q4_1 and Q5_0/Q8_0 as q8_0 without loss and
    requantizes the Q6_K ffn_down matrices to q8_0; float32 holds the file's exact values. Measured
    (362 tokens): float32 18.937, auto 18.935 (-0.01%), all-q8_0 18.946 (+0.05%)."""
    from engine_service.model import load_model
    from engine_service.model.loading.packaged import packaged_path

    try:
        packaged_path("gemma-3-270m")
    except Exception as exc:  # noqa: BLE001 - not installed on this machine
        pytest.skip(f"gemma-3-270m unavailable: {exc}")
    ppl = {}
    for dtype in ("float32", "auto"):
        loaded = load_model("gemma-3-270m", dtype)
        ids = loaded.tokenizer.encode(TEXT, add_special_tokens=True)
        ppl[dtype] = _perplexity(loaded, ids, 64)
        del loaded
    assert 1.5 < ppl["float32"] < 60, ppl
    assert abs(ppl["auto"] / ppl["float32"] - 1) < 0.005, ppl


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_half_precision_kv_perplexity_within_half_a_percent(name):
    """--kv_dtype: float16 / bfloat16 K/V against float32 K/V, the same weights (auto). Measured (362-364
    tokens, 64-row chunks): SmolLM2 21.868 / +0.004% / +0.085%, Gemma 3 18.935 / +0.004% / +0.036%."""
    from engine_service.model import load_model

    try:
        loaded = load_model(name)
    except Exception as exc:  # noqa: BLE001 - a packaged model not installed here
        pytest.skip(f"{name} unavailable: {exc}")
    ids = loaded.tokenizer.encode(TEXT, add_special_tokens=True)
    ppl = {kv: _perplexity(loaded, ids, 64, kv) for kv in ("float32", "float16", "bfloat16")}
    assert 1.5 < ppl["float32"] < 60, ppl
    for kv in ("float16", "bfloat16"):
        assert abs(ppl[kv] / ppl["float32"] - 1) < 0.005, ppl
    assert ppl["float16"] != ppl["float32"]  # the cache really held half precision
