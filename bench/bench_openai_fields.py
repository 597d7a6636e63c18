"""The OpenAI fields of issue 23 on the real model (SmolLM2-135M-Instruct): ``n`` via clones, and the
cost of a JSON-schema mask.

1. ``n`` through the HTTP door (chat, a fresh ~200-token prompt per case and round, nothing cached, --new-tokens each, seeded
   sampling): wall time of one request with ``n=4`` vs one request with ``n=1``, vs 4 separate
   requests sent together and vs 4 sent one after another. ``n=4`` prefills the prompt once and clones
   it for choices 1..3 (``prefix_service/http/choices.py``). Target: n=4 <= 1.6 x one request.
   Median of --rounds rounds (the cases alternate within a round).
2. The mask: llguidance's allowed-token mask per token (``GrammarMatcher.mask``: compute + unpack +
   to an MLX array) replaying a valid document's tokens, vs the engine's decode step (one sequence,
   unconstrained, through a Runner); and a constrained generation's tokens/s vs an unconstrained one
   (which also keeps the decode lookahead). Target: mask < 10% of a decode step.

Prints one JSON object, writes bench/out/bench_openai_fields.json and .png.
Usage: .venv/bin/python bench/bench_openai_fields.py [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import httpx

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from engine_service.api.config import GenConfig
from engine_service.executors.grammar import compile_json_schema, with_grammar
from engine_service.executors.options import ExecutorSettings
from engine_service.model.loading.loader import load_model
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import create_server as create_prefix_server

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
MODEL = "smollm2"
SYSTEM = (
    "You are a careful assistant for a small bookshop. Answer in two or three sentences, name the "
    "section of the shop where the customer finds what they ask for, and suggest one related title. "
) * 3
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"type": "string"}},
        "in_stock": {"type": "boolean"},
    },
    "required": ["title", "author", "year", "genres", "in_stock"],
    "additionalProperties": False,
}
DOCUMENT = {
    "title": "The Left Hand of Darkness",
    "author": "Ursula K. Le Guin",
    "year": 1969,
    "genres": ["science fiction", "anthropology", "classic"],
    "in_stock": True,
}


def chat(http: httpx.Client, question: str, n: int, new_tokens: int, seed: int) -> dict:
    """One chat request; the question opens the system prompt, so no two cases share a cached prefix."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": f"{question}\n{SYSTEM}"},
            {"role": "user", "content": question},
        ],
        "max_tokens": new_tokens,
        "temperature": 1.0,
        "seed": seed,
        "n": n,
    }
    r = http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def together(fns) -> list:
    results: list = [None] * len(fns)

    def run(i: int) -> None:
        results[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def one_round(http: httpx.Client, r: int, new_tokens: int) -> dict[str, tuple[float, dict]]:
    """Each case once, each on a prompt of its own (nothing cached): (seconds, n=4's usage)."""

    def q(case: str) -> str:
        return f"Round {r} ({case}): where do I find books about sailing ships?"

    out = {"one": (timed(lambda: chat(http, q("one"), 1, new_tokens, r))[0], {})}
    seconds, many = timed(lambda: chat(http, q("n4"), 4, new_tokens, r))
    out["n4"] = (seconds, many["usage"])
    fns = [lambda i=i: chat(http, q("together"), 1, new_tokens, r + i) for i in range(4)]
    out["four_together"] = (timed(lambda: together(fns))[0], {})
    out["four_in_turn"] = (
        timed(lambda: [chat(http, q("turn"), 1, new_tokens, r + i) for i in range(4)])[0],
        {},
    )
    return out


def bench_n(loaded, new_tokens: int, rounds: int) -> dict:
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=MODEL,
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=24, max_session_tokens=1024, max_decode_sequences=8),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    gateway, channel = connect_engine(f"127.0.0.1:{port}", max_entries=32)
    prefix_server, _ = create_prefix_server(gateway, "127.0.0.1:0", channel=channel)
    http_port = prefix_server.start_http("127.0.0.1", 0, model_name=MODEL)
    http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=600)
    times: dict[str, list[float]] = {"one": [], "n4": [], "four_together": [], "four_in_turn": []}
    usage: dict = {}
    try:
        chat(http, "Warm-up question?", 1, 4, 0)
        for r in range(rounds):
            for case, (seconds, answer) in one_round(http, r, new_tokens).items():
                times[case].append(seconds)
                usage = answer if case == "n4" else usage
    finally:
        http.close()
        prefix_server.stop(0)
        server.stop(0, shutdown_runner=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "new_tokens": new_tokens,
        "rounds": rounds,
        "n4_usage": usage,
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "runs_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "n4_over_one": round(med["n4"] / med["one"], 3),
        "four_together_over_one": round(med["four_together"] / med["one"], 3),
        "four_in_turn_over_one": round(med["four_in_turn"] / med["one"], 3),
    }


def bench_mask(loaded, new_tokens: int) -> dict:
    from engine_service.executors.module import ModuleExecutor
    from engine_service.runtime.runner import Runner

    tok = loaded.tokenizer
    t0 = time.perf_counter()
    grammar = compile_json_schema(json.dumps(SCHEMA), tok)
    compile_s = time.perf_counter() - t0
    ids = tok.encode(json.dumps(DOCUMENT))
    vocab = loaded.model.config.vocab_size
    per_token = []
    for _ in range(3):
        matcher = grammar.matcher()
        for t in ids:
            t1 = time.perf_counter()
            mask = matcher.mask(vocab)
            import mlx.core as mx

            mx.eval(mask)
            per_token.append(time.perf_counter() - t1)
            matcher.consume(t)
    executor = ModuleExecutor.create(loaded, "batched-sequence", max_sessions=4, max_session_tokens=1024)
    runner = Runner(executor, max_decode_sequences=4)
    prompt = tok.encode("Name a famous novel and describe it as JSON: ", add_special_tokens=True)
    out: dict = {}
    try:
        for name, schema in (("plain", ""), ("constrained", json.dumps(SCHEMA)), ("plain_again", "")):
            config = GenConfig(max_new_tokens=new_tokens, temperature=0.0, json_schema=schema,
                               stop_tokens=tuple(tok.eos_token_ids) if schema else ())  # fmt: skip
            config = with_grammar(config, tok)
            with runner.open_session() as s:
                s.generate_async(prompt, GenConfig(max_new_tokens=2)).wait(120)  # warm
            with runner.open_session() as s:
                result = s.generate_async(prompt, config).wait(300)
            m = result.metrics
            out[name] = {"tokens": m.generated_tokens, "decode_tokens_per_s": round(m.decode_tokens_per_s, 2)}
    finally:
        runner.shutdown()
    plain = max(out["plain"]["decode_tokens_per_s"], out["plain_again"]["decode_tokens_per_s"])
    step_ms = 1000 / plain
    mask_ms = 1000 * statistics.median(per_token)
    return {
        "vocab": vocab,
        "compile_ms": round(compile_s * 1000, 2),
        "mask_ms_median": round(mask_ms, 4),
        "mask_ms_p90": round(1000 * sorted(per_token)[int(0.9 * len(per_token))], 4),
        "decode_step_ms": round(step_ms, 3),
        "mask_share_of_step": round(mask_ms / step_ms, 4),
        "generations": out,
        "constrained_over_plain_tokens_per_s": round(out["constrained"]["decode_tokens_per_s"] / plain, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    loaded = load_model()
    results = {
        "model": os.path.basename(loaded.path),
        "load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()],
        "mask": bench_mask(loaded, 64),
        "n_via_clones": bench_n(loaded, args.new_tokens, args.rounds),
    }
    print(json.dumps(results, indent=2))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_openai_fields.json"), "w") as f:
        json.dump(results, f, indent=2)
    plot(results, os.path.join(OUT, "bench_openai_fields.png"))


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = r["n_via_clones"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["n=1", "n=4 (clones)", "4 requests\ntogether", "4 requests\nin turn"]
    keys = ["one", "n4", "four_together", "four_in_turn"]
    axes[0].bar(
        labels, [n["median_s"][k] for k in keys], color=["tab:gray", "tab:blue", "tab:orange", "tab:red"]
    )
    axes[0].set_ylabel("wall time, s (median)")
    axes[0].set_title(f"{n['new_tokens']} new tokens per choice; n=4 / one = {n['n4_over_one']}")
    m = r["mask"]
    axes[1].bar(["mask per token", "decode step"], [m["mask_ms_median"], m["decode_step_ms"]],
                color=["tab:green", "tab:gray"])  # fmt: skip
    axes[1].set_ylabel("ms")
    axes[1].set_title(f"JSON-schema mask = {100 * m['mask_share_of_step']:.1f}% of a decode step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
