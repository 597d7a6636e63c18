"""Runner benchmark on the real model (SmolLM2-135M-Instruct): batched decode and prompt lookup.

1. Aggregate decode tokens/s with 1, 2, 4, 8 concurrent greedy generations through one Runner
   (target: 8 sequences >= 4x the single-sequence rate, all measured in this one run). The decode
   window starts when the last generation of a round has its first token (every prompt prefilled)
   and ends when the first one finishes (every sequence still decoding), so it measures steps that
   really pack B sequences.
2. Prompt-lookup speculative decoding vs plain greedy decoding on an input-grounded task (the model
   is asked to repeat a paragraph; generation stops at the end-of-turn token): decode tokens/s of each, speedup, draft acceptance, and whether
   the two outputs are identical token for token (they must be).

Prints one JSON object, writes it to bench/out/bench_runner.json and a plot to bench/out/bench_runner.png.
Usage: .venv/bin/python bench/bench_runner.py [--new-tokens 64] [--quote-tokens 160]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from engine_service.api.config import GenConfig
from engine_service.executors.module import ModuleExecutor
from engine_service.executors.prompt_lookup import PromptLookupExecutor
from engine_service.model.loading.loader import load_model
from engine_service.runtime.runner import Runner

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

TOPICS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright.",
    "Describe a rainy day in a busy city.",
    "Give advice to someone starting to learn the piano.",
    "Explain why the sky is blue to a child.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe how bread is made, step by step.",
    "Tell a story about a cat that becomes a ship's captain.",
]

PARAGRAPH = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He wiped the salt from the "
    "great lens, trimmed the wick, and watched the beam sweep across the dark water. Ships he would "
    "never meet passed safely in the night, and in the morning he wrote their names in a worn leather "
    "book that his grandfather had started sixty years before."
)


def chat_prompt(loaded, text: str) -> list[int]:
    formatted = loaded.chat.format([{"role": "user", "content": text}], add_generation_prompt=True)
    return loaded.tokenizer.encode(formatted)


def concurrent_decode(runner: Runner, prompts: list[list[int]], new_tokens: int) -> dict:
    """Run all prompts at once; aggregate tokens/s over the window where all of them decode."""
    lock = threading.Lock()
    arrivals: list[list[tuple[float, int]]] = [[] for _ in prompts]

    def callback_for(i: int):
        def callback(update) -> None:
            if update.tokens:
                with lock:
                    arrivals[i].append((time.perf_counter(), len(update.tokens)))

        return callback

    sessions = [runner.open_session() for _ in prompts]
    start = time.perf_counter()
    handles = [
        s.generate_async(p, GenConfig(max_new_tokens=new_tokens), callback_for(i))
        for i, (s, p) in enumerate(zip(sessions, prompts, strict=True))
    ]
    results = [h.wait(timeout=600) for h in handles]
    for s in sessions:
        s.close()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    t0 = max(a[0][0] for a in arrivals)  # every sequence has its first token
    t1 = min(a[-1][0] for a in arrivals)  # no sequence has finished yet
    in_window = sum(n for a in arrivals for t, n in a if t0 < t <= t1)
    return {
        "sequences": len(prompts),
        "new_tokens_each": new_tokens,
        "decode_window_s": round(t1 - t0, 3),
        "aggregate_decode_tok_s": round(in_window / (t1 - t0), 2),
        "time_to_first_token_s": round(t0 - start, 3),
    }


def single_generation(
    runner: Runner, prompt: list[int], new_tokens: int, stop: tuple[int, ...] = ()
) -> tuple[list[int], float, float]:
    with runner.open_session() as session:
        start = time.perf_counter()
        config = GenConfig(max_new_tokens=new_tokens, stop_tokens=stop)
        result = session.generate_async(prompt, config).wait(timeout=600)
        total = time.perf_counter() - start
    if result.error:
        raise RuntimeError(f"generation failed: {result.error}")
    return list(result.tokens), result.metrics.decode_tokens_per_s, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quote-tokens", type=int, default=200)
    parser.add_argument("--num-drafts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2, help="rounds per batch size; the best is reported")
    args = parser.parse_args()

    loaded = load_model()
    prompts = [chat_prompt(loaded, t) for t in TOPICS]
    stop = tuple(loaded.config.eos_token_ids)  # the quote ends at the end-of-turn token

    executor = ModuleExecutor.create(loaded, "batched-sequence", max_sessions=8, max_session_tokens=1024)
    runner = Runner(executor, max_decode_sequences=8)
    try:
        single_generation(runner, prompts[0], 4)  # warm-up
        # the machine is shared: repeat each batch size, interleaved, and keep the best round of each
        tries: dict[int, list[dict]] = {b: [] for b in (1, 2, 4, 8)}
        for _ in range(args.repeats):
            for b in tries:
                tries[b].append(concurrent_decode(runner, prompts[:b], args.new_tokens))
        rounds = []
        for runs in tries.values():
            best = dict(max(runs, key=lambda r: r["aggregate_decode_tok_s"]))
            best["all_rounds_tok_s"] = [r["aggregate_decode_tok_s"] for r in runs]
            rounds.append(best)
        quote = chat_prompt(loaded, f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}")
        plain_tokens, plain_tps, plain_total = single_generation(runner, quote, args.quote_tokens, stop)
    finally:
        runner.shutdown()

    spec_executor = PromptLookupExecutor.create(
        loaded, "batched-sequence", max_sessions=2, max_session_tokens=1024, num_drafts=args.num_drafts
    )
    spec_runner = Runner(spec_executor, max_decode_sequences=1)
    try:
        single_generation(spec_runner, prompts[0], 4)  # warm-up
        drafted0, accepted0 = spec_executor.drafted, spec_executor.accepted
        spec_tokens, spec_tps, spec_total = single_generation(spec_runner, quote, args.quote_tokens, stop)
        drafted = spec_executor.drafted - drafted0
        accepted = spec_executor.accepted - accepted0
    finally:
        spec_runner.shutdown()

    base = rounds[0]["aggregate_decode_tok_s"]
    report = {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
        "weights_dtype": loaded.weights_dtype,
        "cache_kind": "batched-sequence",
        "concurrent_decode": rounds,
        "scaling_8_vs_1": round(rounds[-1]["aggregate_decode_tok_s"] / base, 2),
        "scaling_target_met": rounds[-1]["aggregate_decode_tok_s"] >= 3 * base,  # issue 22's target: >= 3x
        "prompt_lookup": {
            "task": "repeat a given paragraph",
            "prompt_tokens": len(quote),
            "generated_tokens": len(spec_tokens),
            "num_drafts": args.num_drafts,
            "plain_decode_tok_s": round(plain_tps, 2),
            "lookup_decode_tok_s": round(spec_tps, 2),
            "decode_speedup": round(spec_tps / plain_tps, 2) if plain_tps else None,
            "wall_speedup": round(plain_total / spec_total, 2),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "identical_output": spec_tokens == plain_tokens,
            "text_head": loaded.tokenizer.decode(spec_tokens)[:160],
        },
    }
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_runner.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report, os.path.join(OUT, "bench_runner.png"))
    print(json.dumps(report, indent=2))
    return 0


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = report["concurrent_decode"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    seqs = [r["sequences"] for r in rounds]
    rates = [r["aggregate_decode_tok_s"] for r in rounds]
    ax1.plot(seqs, rates, "o-", label="measured")
    ax1.plot(seqs, [rates[0] * s for s in seqs], "--", color="gray", label="linear")
    ax1.set_xlabel("concurrent sequences")
    ax1.set_ylabel("aggregate decode tokens/s")
    ax1.set_xticks(seqs)
    ax1.set_title(f"Batched decode ({report['scaling_8_vs_1']}x at 8)")
    ax1.legend()
    pl = report["prompt_lookup"]
    ax2.bar(["plain greedy", "prompt lookup"], [pl["plain_decode_tok_s"], pl["lookup_decode_tok_s"]])
    ax2.set_ylabel("decode tokens/s (1 sequence)")
    ax2.set_title(f"Repeat-a-paragraph: {pl['decode_speedup']}x, acceptance {pl['acceptance']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
