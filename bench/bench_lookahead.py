"""Decode through a Runner with the executor's lookahead on and off, in one window (issue 22).

The lookahead (``ModuleExecutor(lookahead=True)``) queues decode step n + 1 before step n's tokens are
read back. This measures what it buys: one sequence's decode tokens/s at a few depths and 2 / 4 / 8
sequences' aggregate, on and off alternating (``--repeats`` rounds, best of each), plus how many lookahead steps
were used / discarded. Prints JSON, writes bench/out/bench_lookahead.json.

    .venv/bin/python bench/bench_lookahead.py [--model smollm2-135m] [--depths 16 512] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [1000 + (i * 7919 + salt * 131) % 29000 for i in range(n)]


def one_case(runner, executor, prompts: list[list[int]], steps: int) -> dict:
    from bench_runner import concurrent_decode

    used, dropped = executor.lookahead_used, executor.lookahead_discarded
    r = concurrent_decode(runner, prompts, steps)
    return {
        "tok_s": r["aggregate_decode_tok_s"],
        "lookahead_used": executor.lookahead_used - used,
        "lookahead_discarded": executor.lookahead_discarded - dropped,
    }


def measure(
    name: str, depths: list[int], batch_sizes: list[int], steps: int, repeats: int, kv_dtype: str
) -> dict:
    from engine_service.executors.module import ModuleExecutor
    from engine_service.model import load_model
    from engine_service.runtime.runner import Runner

    loaded = load_model(name)
    setups = {}
    for on in (True, False):
        ex = ModuleExecutor.create(loaded, "batched-sequence", max_sessions=9,
                                   max_session_tokens=max(depths) + steps + 8, kv_dtype=kv_dtype,
                                   lookahead=on)  # fmt: skip
        setups[on] = (Runner(ex, max_decode_sequences=8), ex)
    cases = {f"one_d{d}": [prompt_of(d)] for d in depths}
    for n in batch_sizes:
        cases[f"batch{n}_d64"] = [prompt_of(64, i) for i in range(n)]
    out: dict = {
        "model": name,
        "kv_dtype": kv_dtype,
        "steps": steps,
        "lookahead_on": setups[True][1].lookahead,
    }
    try:
        for runner, ex in setups.values():  # warm both
            one_case(runner, ex, [prompt_of(16)], 4)
        for case, prompts in cases.items():
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for _ in range(repeats):
                for on in (True, False):
                    runs[on].append(one_case(*setups[on], prompts, steps))
            best = {on: max(rs, key=lambda r: r["tok_s"]) for on, rs in runs.items()}
            out[case] = {
                "on": best[True],
                "off": best[False],
                "ratio_on_off": round(best[True]["tok_s"] / best[False]["tok_s"], 3),
            }
            print(json.dumps({case: out[case]}), file=sys.stderr, flush=True)
    finally:
        for runner, _ in setups.values():
            runner.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--depths", nargs="+", type=int, default=[16, 512])
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv_dtype", default="auto")
    args = parser.parse_args()
    t0 = time.perf_counter()
    report = {"load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()]}
    report.update(measure(args.model, args.depths, args.batch_sizes, args.steps, args.repeats, args.kv_dtype))
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "bench_lookahead.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
