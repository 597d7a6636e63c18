"""The compiled CPU kernels (q8_0, q4_1) against float32 OpenBLAS, on SmolLM2-135M's shapes and model.

    .venv/bin/python bench/bench_kernels.py [--quick]

Prints one JSON document and writes bench/out/bench_kernels.png. All ratios come from one run.

- matmul: ``x [M, K] @ W.T`` for each projection shape of the packaged model (fused q/k/v and gate/up,
  o, down, the tied head), M = 1 and 8: median seconds over ``reps``, GFLOP/s (2*M*N*K) and weight
  GB/s (the bytes of W the call reads: float32 4, q8_0 1.125, q4_1 0.75 per weight).
- model (the packaged SmolLM2-135M in each format, one after the other in this process):
  - ``decode_tok_s``: greedy decode of one sequence after a 64-token prompt (engine_service.greedy,
    pipelined with mx.async_eval; the first token excluded);
  - ``runner_decode_1_tok_s`` / ``runner_decode_8_tok_s``: the engine path (Runner + ModuleExecutor,
    batched-sequence cache), 1 and 8 sequences decoding together after distinct 32-token prompts,
    aggregate tokens per second over the window where all of them decode;
  - ``prefill_tok_s``: best of 2 prefills of 512 and 1024 tokens (512-position chunks, as the engine);
  - ``hit_ttft_s``: a prefix hit: clone a session holding a 1024-token prompt at its end and feed 16
    new tokens, timed from the clone request to the first token's callback (median);
  - ``weight_bytes``: resident bytes of the model's parameters.
- llama_cpp (only when the ``llama_cpp`` package imports): its decode of the same GGUF, same threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import engine_service  # noqa: E402,F401,I001  (OpenBLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from engine_service.model.formats.block_quant import block_matmul, to_q4_1, to_q8_0  # noqa: E402
from engine_service.model.cpu_kernels import kernel_status  # noqa: E402

FORMATS = ("float32", "q8_0", "q4_1")
# (name, N, K) of SmolLM2-135M: hidden 576, 9 q heads + 3 kv heads of 64, intermediate 1536, vocab 49152
SHAPES = (
    ("qkv", 960, 576),
    ("o", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("head", 49152, 576),
)
BYTES_PER_WEIGHT = {"float32": 4.0, "q8_0": 1.125, "q4_1": 0.75}


def time_call(fn, reps: int) -> float:
    mx.eval(fn())  # warm up (first call allocates, starts the pool)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_matmuls(reps: int) -> list[dict]:
    rows = []
    for name, n, k in SHAPES:
        w = mx.random.normal((n, k), key=mx.random.key(n + k)) * 0.05
        weights = {"float32": w, "q8_0": to_q8_0(w), "q4_1": to_q4_1(w)}
        mx.eval(w, *(t.wq for t in list(weights.values())[1:]))
        for m in (1, 8):
            x = mx.random.normal((m, k), key=mx.random.key(m))
            mx.eval(x)
            for fmt, t in weights.items():
                fn = (lambda x=x, t=t: x @ t.T) if fmt == "float32" else (lambda x=x, t=t: block_matmul(x, t))
                s = time_call(fn, reps)
                rows.append(
                    {
                        "shape": name,
                        "n": n,
                        "k": k,
                        "m": m,
                        "format": fmt,
                        "seconds": s,
                        "gflops": 2 * m * n * k / s / 1e9,
                        "weight_gbps": n * k * BYTES_PER_WEIGHT[fmt] / s / 1e9,
                    }
                )
    return rows


def _first_token_s(session, tokens, started: float) -> float:
    """Seconds from ``started`` to the first token's callback of a 1-token generation on ``session``."""
    from engine_service.api.config import GenConfig

    stamp: list[float] = []

    def on_update(update) -> None:
        if update.tokens and not stamp:
            stamp.append(time.perf_counter())

    result = session.generate_async(list(tokens), GenConfig(max_new_tokens=1), on_update).wait(600)
    assert result.error is None and stamp, result.error
    return stamp[0] - started


def _runner_decode(runner, n_seqs: int, steps: int) -> float:
    """Aggregate tok/s of ``n_seqs`` sessions decoding together (the window where all of them decode)."""
    from engine_service.api.config import GenConfig

    stamps: list[list[float]] = [[] for _ in range(n_seqs)]
    sessions = [runner.open_session() for _ in range(n_seqs)]
    handles = []
    for i, session in enumerate(sessions):

        def on_update(update, mine=stamps[i]) -> None:
            mine.extend([time.perf_counter()] * len(update.tokens))

        prompt = [(j * 31 + i * 101) % 4000 + 100 for j in range(32)]
        handles.append(session.generate_async(prompt, GenConfig(max_new_tokens=steps + 1), on_update))
    for handle in handles:
        assert handle.wait(600).error is None
    for session in sessions:
        session.close()
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    tokens = sum(1 for s in stamps for t in s if start < t <= end)
    return tokens / (end - start)


def _hit_ttft(runner, vocab: int, prompt_tokens: int, suffix: int, repeats: int) -> float:
    """Median seconds from a clone at the end of a stored ``prompt_tokens`` prompt to the first token
    after feeding ``suffix`` new tokens to the clone."""
    from engine_service.api.config import GenConfig

    source = runner.open_session()
    prompt = [(j * 53) % (vocab - 200) + 100 for j in range(prompt_tokens)]
    assert source.generate_async(prompt, GenConfig(max_new_tokens=1)).wait(600).error is None
    times = []
    for r in range(repeats + 1):  # the first one warms up
        started = time.perf_counter()
        clone = source.clone_async(prompt_tokens).result(600)
        assert clone is not None
        times.append(_first_token_s(clone, [(r * 7 + j * 13) % 4000 + 100 for j in range(suffix)], started))
        clone.close()
    source.close()
    return statistics.median(times[1:])


def bench_model(fmt: str, decode_steps: int, prefill_lengths: tuple[int, ...], repeats: int) -> dict:
    import gc

    from engine_service.executors.module import ModuleExecutor
    from engine_service.greedy import greedy_tokens, new_cache, prefill
    from engine_service.model import load_model
    from engine_service.runtime.runner import Runner

    loaded = load_model(None, fmt)
    model = loaded.model
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    prompt = [(i * 37) % 4000 + 100 for i in range(64)]
    cache = new_cache(model, len(prompt) + decode_steps + 2)
    stamps = []
    for _ in greedy_tokens(model, cache, cache.seq_new(), prompt, decode_steps + 1):
        stamps.append(time.perf_counter())
    decode = decode_steps / (stamps[-1] - stamps[0])
    del cache
    prefill_tok_s = {}
    for n in prefill_lengths:
        long_prompt = [(i * 53) % 4000 + 100 for i in range(n)]
        best = float("inf")
        for _ in range(2):
            cache = new_cache(model, n + 1)
            t0 = time.perf_counter()
            mx.eval(prefill(model, cache, cache.seq_new(), long_prompt))
            best = min(best, time.perf_counter() - t0)
            del cache
        prefill_tok_s[str(n)] = n / best
    hit_prompt = max(prefill_lengths)
    runner = Runner(
        ModuleExecutor.create(
            loaded, "batched-sequence", max_sessions=10, max_session_tokens=hit_prompt + 64
        ),
        max_decode_sequences=8,
    )
    try:
        compute_path = runner.compute_path
        runner_1 = _runner_decode(runner, 1, decode_steps)
        runner_8 = _runner_decode(runner, 8, decode_steps)
        hit = _hit_ttft(runner, loaded.config.vocab_size, hit_prompt, 16, repeats)
    finally:
        runner.shutdown()
    del runner, model, loaded
    gc.collect()
    return {
        "format": fmt,
        "compute_path": compute_path,
        "decode_tok_s": decode,
        "runner_decode_1_tok_s": runner_1,
        "runner_decode_8_tok_s": runner_8,
        "prefill_tok_s": prefill_tok_s,
        "hit_prompt_tokens": hit_prompt,
        "hit_suffix_tokens": 16,
        "hit_ttft_s": hit,
        "weight_bytes": weight_bytes,
    }


def bench_llama_cpp(steps: int) -> dict | None:
    """llama.cpp's decode of the packaged GGUF on as many threads as the kernels use (None when the
    ``llama_cpp`` package does not import: it is never a dependency)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from engine_service.model.loading.loader import default_model_path

    threads = kernel_status().threads or os.cpu_count()
    llm = llama_cpp.Llama(model_path=default_model_path(), n_ctx=512, n_threads=threads, verbose=False)
    prompt = [(i * 37) % 4000 + 100 for i in range(64)]
    stamps = []
    for _ in llm.generate(prompt, temp=0.0):
        stamps.append(time.perf_counter())
        if len(stamps) > steps:
            break
    return {"threads": threads, "decode_tok_s": steps / (stamps[-1] - stamps[0])}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    metrics = ("decode_1", "runner_decode_8", "prefill_512", "prefill_1024", "hit_ttft")
    ratios = result["ratios_vs_float32"]
    width = 0.38
    for j, fmt in enumerate(ratios):
        vals = [ratios[fmt][m] for m in metrics]
        xs = [i + (j - 0.5) * width for i in range(len(metrics))]
        ax1.bar(xs, vals, width, label=fmt)
        for x, v in zip(xs, vals, strict=True):
            ax1.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax1.axhline(1.0, color="#888", lw=0.8)
    ax1.set_xticks(
        range(len(metrics)),
        ["decode 1", "decode 8", "prefill 512", "prefill 1024", "hit+16 TTFT"],
        fontsize=8,
    )
    ax1.set_title("SmolLM2-135M, speed vs float32 OpenBLAS (x)")
    ax1.legend()
    names = [f"{name}\nM={m}" for name, _, _ in SHAPES for m in (1, 8)]
    width = 0.27
    for j, fmt in enumerate(FORMATS):
        vals = [r["weight_gbps"] for r in result["matmul"] if r["format"] == fmt]
        ax2.bar([i + (j - 1) * width for i in range(len(vals))], vals, width, label=fmt)
    ax2.set_xticks(range(len(names)), names, fontsize=7)
    ax2.set_ylabel("weight GB/s")
    ax2.set_title("x @ W.T: weight bytes read per second")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and decode steps")
    args = parser.parse_args()
    status = kernel_status()
    if not status.available:
        sys.exit(f"bench_kernels: {status.describe()}")
    reps, steps, repeats = (5, 16, 3) if args.quick else (20, 48, 7)
    result = {
        "kernels": status.describe(),
        "matmul": bench_matmuls(reps),
        "model": [bench_model(fmt, steps, (512, 1024), repeats) for fmt in FORMATS],
        "llama_cpp": bench_llama_cpp(steps),
    }
    base = result["model"][0]
    result["ratios_vs_float32"] = {
        m["format"]: {
            "decode_1": m["decode_tok_s"] / base["decode_tok_s"],
            "runner_decode_1": m["runner_decode_1_tok_s"] / base["runner_decode_1_tok_s"],
            "runner_decode_8": m["runner_decode_8_tok_s"] / base["runner_decode_8_tok_s"],
            "prefill_512": m["prefill_tok_s"]["512"] / base["prefill_tok_s"]["512"],
            "prefill_1024": m["prefill_tok_s"]["1024"] / base["prefill_tok_s"]["1024"],
            "hit_ttft": base["hit_ttft_s"] / m["hit_ttft_s"],  # speedup: float32 time / this time
            "weight_bytes": m["weight_bytes"] / base["weight_bytes"],
        }
        for m in result["model"][1:]
    }
    if result["llama_cpp"] is not None:
        result["llama_cpp"]["over"] = {
            m["format"]: result["llama_cpp"]["decode_tok_s"] / m["decode_tok_s"] for m in result["model"]
        }
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out, "bench_kernels.png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
