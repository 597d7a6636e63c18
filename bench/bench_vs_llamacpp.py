"""forkline side by side with llama.cpp on the same GGUF, in one window: decode at depth 16 / 512 / 1,536 /
4,096, prefill 512 / 1,024, 8 sequences decoding together, and through the HTTP doors a long chat
prompt cold, a prefix hit's first token and decode (a base model without a chat template, Gemma 3
270M: the same text as a plain prompt through ``/v1/completions`` on both sides). Without ``--llama_bench`` / ``--llama_server`` it
runs forkline alone. Prints one JSON document with ratios, writes bench/out/bench_vs_llamacpp.png.

    .venv/bin/python bench/bench_vs_llamacpp.py [--models smollm2-135m gemma-3-270m] [--quick]
        [--llama_bench PATH] [--llama_server PATH] [--threads 2]

- Raw model (both sides single-sequence, greedy): forkline ``engine_service.greedy`` (prefill chunks
  of 512, decode with ``mx.async_eval`` pipelining) vs ``llama-bench -p`` / ``-n 32 -d DEPTH``.
- 8 sequences: one forkline Runner decoding 8 prompts together, aggregate tokens/s over the window
  where all 8 decode, as a ratio to one sequence through the same Runner (target >= 3x).
- llama.cpp's binaries: built as ``../shared/PEERS.md`` says, except where the CPU reports AMX but the
  VM does not enable it (``llama-bench`` dies with SIGILL in ``ggml_backend_amx_mul_mat``): there build
  with ``-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
  -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF`` (what docs/BENCHMARKS.md's figures used).
- HTTP: ``forkline-engine`` + ``forkline-prefix --http_port`` processes vs ``llama-server -np 4``, the
  same OpenAI chat requests (streamed, greedy): a ~1,500-token system prompt with a question (cold),
  then the same system prompt with another question (a prefix hit: time to the first content token),
  and decode tokens/s of that second answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)

MODELS = ("smollm2-135m", "gemma-3-270m")
DEPTHS = (16, 512, 1536, 4096)
SYSTEM = (
    "You are a careful assistant for a city library. The library opens at nine and closes at six on "
    "weekdays, at four on Saturdays, and stays closed on Sundays and public holidays. Members may borrow "
    "up to twelve items for three weeks and renew them twice online unless someone has reserved them. "
) * 22


def raw(name: str, quick: bool) -> dict:
    import mlx.core as mx

    from engine_service.greedy import new_cache, prefill
    from engine_service.model import load_model

    loaded = load_model(name)
    model = loaded.model
    depths = DEPTHS[:2] if quick else DEPTHS
    prompt = [1000 + (i * 7919) % 29000 for i in range(max(depths) + 1100)]
    out = {"weights_dtype": loaded.weights_dtype, "prefill": {}, "decode": {}}
    warm = new_cache(model, 65, kv_dtype="auto")
    mx.eval(prefill(model, warm, warm.seq_new(), prompt[:64]))
    out["prefill"] = forkline_prefill(model, (512,) if quick else (512, 1024), reps=2)
    out["decode"] = forkline_decode(model, depths, 16 if quick else 48)
    return out


def forkline_prefill(model, sizes, reps: int = 1) -> dict[str, float]:
    """Prefill tokens/s of a fresh sequence of each size (chunks of 512, the best of ``reps``)."""
    import mlx.core as mx

    from engine_service.greedy import new_cache, prefill

    prompt = [1000 + (i * 7919) % 29000 for i in range(max(sizes))]
    out = {}
    for n in sizes:
        times = []
        for _ in range(reps):
            cache = new_cache(model, n + 1, kv_dtype="auto")
            t0 = time.perf_counter()
            mx.eval(prefill(model, cache, cache.seq_new(), prompt[:n]))
            times.append(time.perf_counter() - t0)
        out[str(n)] = round(n / min(times), 1)
    return out


def forkline_decode(model, depths, steps: int) -> dict[str, float]:
    """Greedy decode tokens/s of one sequence after a prompt of each depth (the engine's step: the
    fused kernels, ``mx.async_eval`` pipelining)."""
    from engine_service.greedy import GenerationStats, greedy_tokens, new_cache

    prompt = [1000 + (i * 7919) % 29000 for i in range(max(depths) + 1)]
    out = {}
    for depth in depths:
        cache = new_cache(model, depth + steps + 2, kv_dtype="auto")
        stats = GenerationStats()
        for _ in greedy_tokens(model, cache, cache.seq_new(), prompt[:depth], steps, stats=stats):
            pass
        out[str(depth)] = round((stats.generated - 1) / stats.decode_s, 2)
    return out


def batched(name: str, quick: bool) -> dict:
    from bench_runner import concurrent_decode

    from engine_service.executors.module import ModuleExecutor
    from engine_service.model import load_model
    from engine_service.runtime.runner import Runner

    loaded = load_model(name)
    executor = ModuleExecutor.create(
        loaded, "batched-sequence", max_sessions=9, max_session_tokens=512, kv_dtype="auto"
    )
    runner = Runner(executor, max_decode_sequences=8)
    try:
        prompts = [[1000 + (i * 131 + j * 7919) % 29000 for j in range(64)] for i in range(8)]
        steps = 24 if quick else 64
        pairs = []  # one sequence, then eight, back to back: the machine's load moves between rounds
        for _ in range(1 if quick else 3):
            one = concurrent_decode(runner, prompts[:1], steps)["aggregate_decode_tok_s"]
            eight = concurrent_decode(runner, prompts, steps)["aggregate_decode_tok_s"]
            pairs.append((one, eight))
    finally:
        runner.shutdown()
    ratios = sorted(e / o for o, e in pairs)
    return {
        "one_tok_s": [o for o, _ in pairs],
        "eight_aggregate_tok_s": [e for _, e in pairs],
        "ratio": round(statistics.median(ratios), 2),
        "ratio_per_round": [round(e / o, 2) for o, e in pairs],
    }


def llama_bench(
    binary: str,
    path: str,
    threads: int,
    quick: bool,
    depths=None,
    prefill: bool = True,
    reps: int = 2,
    sizes: str | None = None,
) -> dict:
    """llama-bench's prefill (-p ``sizes``, unless not ``prefill``) and decode at each depth (-n 32 -d
    ...; none when ``depths`` is empty) on ``path``."""
    import subprocess

    depths = (DEPTHS[:2] if quick else DEPTHS) if depths is None else depths
    sizes = sizes or ("512" if quick else "512,1024")
    base = [binary, "-m", path, "-t", str(threads), "-r", str(reps), "-o", "json"]
    out = {"prefill": {}, "decode": {}}
    runs = [["-p", "0", "-n", "32", "-d", ",".join(map(str, depths))]] if depths else []
    for extra in ([["-p", sizes, "-n", "0"]] if prefill else []) + runs:
        rows = json.loads(subprocess.run(base + extra, capture_output=True, text=True, check=True).stdout)
        for row in rows:
            if row.get("n_gen", 0):
                out["decode"][str(row.get("n_depth", 0))] = round(row["avg_ts"], 2)
            else:
                out["prefill"][str(row["n_prompt"])] = round(row["avg_ts"], 1)
    return out


# models without a chat template (base models): the same prompt as plain text through /v1/completions
BASE_MODELS = ("gemma-3-270m",)


def stream_chat(base: str, model: str, question: str, max_tokens: int, chat: bool = True) -> dict:
    """One streamed greedy request: time to the first content chunk, decode tokens/s after it. chat:
    /v1/chat/completions (system prompt + question); else /v1/completions over the same text."""
    from workload_client import http_client

    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens}
    if chat:
        body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    else:
        body["prompt"] = f"{SYSTEM}\nQuestion: {question}\nAnswer:"
    route = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    first, chunks, last = None, 0, t0
    with http_client().stream("POST", base + route, json=body) as r:
        if r.status_code >= 400:
            raise RuntimeError(f"{base} answered {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            delta = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
            if delta:
                now = time.perf_counter()
                first = first if first is not None else now
                chunks += 1
                last = now
    decode = (chunks - 1) / (last - first) if first is not None and chunks > 1 else 0.0
    return {
        "ttft_s": round((first or last) - t0, 3),
        "content_chunks": chunks,
        "decode_tok_s": round(decode, 1),
    }


def http_case(base: str, model: str, quick: bool, chat: bool = True) -> dict:
    n = 32 if quick else 96
    cold = stream_chat(base, model, "When does the library close on Saturdays?", n, chat)
    hits = [stream_chat(base, model, q, n, chat) for q in ("How many items may I borrow?", "Can I renew a book twice?",
                                                            "Is the library open on Sundays?")]  # fmt: skip
    return {"cold_ttft_s": cold["ttft_s"], "hit_ttft_s": statistics.median(h["ttft_s"] for h in hits),
            "decode_tok_s": statistics.median(h["decode_tok_s"] for h in hits)}  # fmt: skip


def forkline_http(name: str, quick: bool) -> dict:
    from clients.demo import Service

    engine = Service(
        "forkline-engine", ["engine_service", "--port", "0", "--model", name, "--log_level", "WARNING"]
    )
    try:
        import re
        import subprocess
        import threading

        proc = subprocess.Popen(
            [sys.executable, "-m", "prefix_service", "--engine", engine.address, "--port", "0", "--http_port", "0", "--http_model_name", name,
             "--log_level", "WARNING"],
            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
        found: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in proc.stdout:
                m = re.search(r"HTTP listening on (\S+:\d+)", line)
                if m:
                    found.append(m.group(1))
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(180):
            raise RuntimeError("forkline-prefix HTTP door did not start")
        try:
            return http_case(f"http://{found[0]}", name, quick, chat=name not in BASE_MODELS)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:  # its drain outlived the allowance: the figures are taken
                proc.kill()
                proc.wait(10)
    finally:
        engine.stop()


def llama_http(binary: str, path: str, threads: int, quick: bool, chat: bool = True) -> dict:
    from llama_server import LlamaServer

    with LlamaServer(binary, path, threads=threads, ctx=16384, slots=4) as server:
        return http_case(server.base, "model", quick, chat)


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if a and b else None


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, (name, r) in zip(axes[0], models.items(), strict=True):
        labels = [f"decode d{k}" for k in r["forkline"]["decode"]] + [
            f"prefill {k}" for k in r["forkline"]["prefill"]
        ]
        ours = list(r["forkline"]["decode"].values()) + list(r["forkline"]["prefill"].values())
        theirs = [r.get("llama_cpp", {}).get("decode", {}).get(k, 0) for k in r["forkline"]["decode"]]
        theirs += [r.get("llama_cpp", {}).get("prefill", {}).get(k, 0) for k in r["forkline"]["prefill"]]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="forkline")
        ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="llama.cpp")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=7, rotation=20)
        ax.set_yscale("log")
        ax.set_title(f"{name}: tokens/s")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--quick", action="store_true", help="fewer depths and tokens (smoke run)")
    parser.add_argument("--llama_bench", default=None, metavar="PATH")
    parser.add_argument("--llama_server", default=None, metavar="PATH")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no_http", action="store_true", help="skip the HTTP case")
    args = parser.parse_args()
    from engine_service.model.loading.packaged import resolve_model

    t0 = time.perf_counter()
    report = {"load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "models": {}}
    for name in args.models:
        r: dict = {"forkline": raw(name, args.quick)}
        print(json.dumps({name: r}), file=sys.stderr, flush=True)  # each part as it comes
        r["batched"] = batched(name, args.quick)
        print(json.dumps({name: {"batched": r["batched"]}}), file=sys.stderr, flush=True)
        if args.llama_bench:
            r["llama_cpp"] = llama_bench(args.llama_bench, resolve_model(name), args.threads, args.quick)
            r["ratios"] = {
                kind: {k: ratio(v, r["llama_cpp"][kind].get(k, 0)) for k, v in r["forkline"][kind].items()}
                for kind in ("prefill", "decode")
            }
            print(
                json.dumps({name: {"llama_cpp": r["llama_cpp"], "ratios": r["ratios"]}}),
                file=sys.stderr,
                flush=True,
            )
        if not args.no_http:
            try:
                r["http"] = {"forkline": forkline_http(name, args.quick)}
            except RuntimeError as exc:  # reported, and the other models still run
                r["http"] = {"forkline": {"error": str(exc)}}
                print(json.dumps({name: r["http"]}), file=sys.stderr, flush=True)
                report["models"][name] = r
                continue
            print(json.dumps({name: {"http": r["http"]}}), file=sys.stderr, flush=True)
            if args.llama_server:
                h = r["http"]["llama_cpp"] = llama_http(
                    args.llama_server, resolve_model(name), args.threads, args.quick, name not in BASE_MODELS
                )
                f = r["http"]["forkline"]
                r["http"]["ratios"] = {"hit_ttft_vs_llama_server": ratio(f["hit_ttft_s"], h["hit_ttft_s"]),
                                       "decode_vs_llama_server": ratio(f["decode_tok_s"], h["decode_tok_s"])}  # fmt: skip
        report["models"][name] = r
        print(json.dumps({name: r}), file=sys.stderr, flush=True)
    png = os.path.join(HERE, "out", "bench_vs_llamacpp.png")
    plot(report, png)
    report["plot"] = os.path.relpath(png, ROOT)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
