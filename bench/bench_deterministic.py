"""The cost of deterministic mode: prefill and decode tok/s, deterministic vs ordinary, in one run.

Real model (packaged SmolLM2-135M) with q8_0 weights through the compiled kernels in both modes, so
the difference is the mode alone (batch-invariant attention; the kernels' linears are row-invariant
already). In-process ModuleExecutor, batched-sequence cache:

- prefill: one session reads a ``--prompt``-token prompt in one forward (tok/s = prompt / seconds).
- decode: ``B`` sessions, each after a ``--prompt``-token prefill, take ``--steps`` greedy steps in
  shared forwards (tok/s = B * steps / seconds), for B = 1 and 8.

Targets (issue 15): decode within 10% of ordinary, prefill within 30%. Medians over ``--repeats``, the
two modes alternating (a shared machine's load then weighs on both alike).
Prints JSON, writes bench/out/bench_deterministic.json and bench/out/bench_deterministic.png.

Usage: .venv/bin/python bench/bench_deterministic.py [--prompt 512] [--steps 16] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.executors.base import ExecInput
from engine_service.executors.module import ModuleExecutor

OUT = Path(__file__).resolve().parent / "out"


def prefill_s(ex: ModuleExecutor, prompt: list[int]) -> float:
    sid = ex.open_session()
    started = time.perf_counter()
    out = ex.execute([ExecInput(sid, 0, tokens=tuple(prompt))])[0]
    took = time.perf_counter() - started
    assert out.error is None, out.error
    ex.close_session(sid)
    return took


def decode_s(ex: ModuleExecutor, prompts: list[list[int]], steps: int) -> float:
    sids = [ex.open_session() for _ in prompts]
    outs = ex.execute([ExecInput(s, 0, tokens=tuple(p)) for s, p in zip(sids, prompts, strict=True)])
    toks = [o.tokens[-1] for o in outs]
    started = time.perf_counter()
    for _ in range(steps):
        outs = ex.execute(
            [ExecInput(s, ex.position(s), tokens=(t,)) for s, t in zip(sids, toks, strict=True)]
        )
        toks = [o.tokens[-1] for o in outs]
    took = time.perf_counter() - started
    for s in sids:
        ex.close_session(s)
    return took


def measure(loaded, prompt_len: int, steps: int, repeats: int) -> list[dict]:
    """Both modes, interleaved per repeat (other jobs on a shared machine load both alike)."""
    ex = ModuleExecutor.create(
        loaded,
        "batched-sequence",
        max_sessions=8,
        max_session_tokens=prompt_len + steps + 8,
        prefill_chunk=prompt_len,
    )
    rng = random.Random(7)
    vocab = loaded.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(8)]
    times: dict[bool, dict[str, list[float]]] = {
        det: {"prefill": [], "b1": [], "b8": []} for det in (False, True)
    }
    rows = {}
    for det in (False, True):
        loaded.model.set_deterministic(det)
        prefill_s(ex, prompts[0][:32])  # warm-up
        rows[det] = {"mode": "deterministic" if det else "ordinary", "fingerprint": ex.fingerprint()}
    for i in range(repeats):
        for det in (False, True):
            loaded.model.set_deterministic(det)
            times[det]["prefill"].append(prefill_s(ex, prompts[i % 8]))
            times[det]["b1"].append(decode_s(ex, prompts[:1], steps))
            times[det]["b8"].append(decode_s(ex, prompts, steps))
    for det, row in rows.items():
        row["prefill_tok_s"] = prompt_len / statistics.median(times[det]["prefill"])
        row["decode_b1_tok_s"] = steps / statistics.median(times[det]["b1"])
        row["decode_b8_tok_s"] = 8 * steps / statistics.median(times[det]["b8"])
    loaded.model.set_deterministic(False)
    return [rows[False], rows[True]]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["mode"]: r for r in result["rows"]}
    keys = (
        ("prefill_tok_s", f"prefill {result['prompt_tokens']} tok"),
        ("decode_b1_tok_s", "decode, 1 session"),
        ("decode_b8_tok_s", "decode, 8 sessions"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, (key, title) in zip(axes, keys, strict=True):
        values = [rows["ordinary"][key], rows["deterministic"][key]]
        ax.bar(["ordinary", "deterministic"], values, color=["#888", "#37c"])
        ax.text(1, values[1], f"{values[1] / values[0]:.2f}x", ha="center", va="bottom")
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
    fig.suptitle("Deterministic mode cost (SmolLM2-135M, q8_0 kernels, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill and decode context)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per mode, the modes interleaved")
    parser.add_argument("--quick", action="store_true", help="128-token prompt, 4 steps, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.prompt, args.steps, args.repeats = 128, 4, 1
    from engine_service.model.cpu_kernels import kernel_status
    from engine_service.model.loading.loader import load_model

    loaded = load_model(None, "q8_0")
    rows = measure(loaded, args.prompt, args.steps, args.repeats)
    ordinary, det = rows
    result = {
        "model": loaded.path,
        "weights_dtype": "q8_0",
        "kernels": kernel_status().describe(),
        "prompt_tokens": args.prompt,
        "decode_steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
        "deterministic_over_ordinary": {
            k: det[k] / ordinary[k] for k in ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s")
        },
    }
    print(json.dumps(result, indent=2))
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_deterministic.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, OUT / "bench_deterministic.png")


if __name__ == "__main__":
    main()
