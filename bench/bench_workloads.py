"""Prefix-cache workloads through both HTTP doors: forkline (engine + prefix service, default flags) and
llama-server (``-np 4 -c 16384``), the same streamed OpenAI requests, one server at a time (restarted per
workload), one window. Per workload and server: cached share (``usage.prompt_tokens_details.cached_tokens``
over prompt tokens), the ideal cache's share from the token ids (bench/ideal_cache.py), TTFT p50/p99,
wall time, bytes held at the end; ratios forkline / llama-server. Prints JSON, draws a PNG next to --out.

    .venv/bin/python bench/bench_workloads.py --model smollm2 [gemma3] [--quick] [--out bench/out/w.json]
        [--workloads shared_prefix ...] [--llama_server PATH | --no_llama]
        [--sweep max_positions=2000,8000,0] [--prefix_flags="--policy lru"] [--engine_flags=...]

Shapes: bench/workload_shapes.py. ``--sweep FLAG=V1,V2,..`` runs forkline alone once per value of a prefix
service flag and flags a workload where TTFT p50 rises while the cached share rises between two settings.
The machine is shared: absolute figures are noisy, the ratios come from one window.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from ideal_cache import RequestLog, ideal_replay, share  # noqa: E402
from workload_client import Sent, body_for, llama_tokenizer, local_tokenizer, run_workload, stream  # noqa: E402
from workload_servers import Forkline, bytes_per_position, llama_held  # noqa: E402
from workload_shapes import NAMES, Item, Words, workloads  # noqa: E402

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)

ALIASES = {"smollm2": "smollm2-135m", "gemma3": "gemma-3-270m"}
BASE_MODELS = ("gemma-3-270m",)  # no chat template: the conversation as plain text, /v1/completions
LLAMA_SERVER = "/work/llama/build/bin/llama-server"
LLAMA_CTX = 16384


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


def summarize(sents: list[Sent], wall: float, tokenize, tokenize_answer, position_bytes: int) -> dict:
    """A workload's figures from its requests (send order) and the server's own tokenization."""
    ok = [s for s in sents if not s.error]
    logs = [
        RequestLog(tuple(ids), tuple(tokenize_answer(s.answer)) if s.answer else (), s.sent_s, s.done_s)
        for s, ids in ((s, tokenize(s.body)) for s in ok)
    ]
    hits, radix_positions = ideal_replay(logs)
    prompt = sum(s.prompt_tokens for s in ok)
    return {
        "requests": len(sents),
        "errors": len(sents) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": sum(s.cached_tokens for s in ok),
        "cached_share": round(sum(s.cached_tokens for s in ok) / prompt, 4) if prompt else 0.0,
        "ideal_share": share(hits, [len(g.prompt) for g in logs]),
        "prompt_length_mismatches": sum(
            len(g.prompt) != s.prompt_tokens for g, s in zip(logs, ok, strict=True)
        ),
        "ideal_radix_bytes": radix_positions * position_bytes,
        "ttft_p50_s": percentile([s.ttft_s for s in ok], 0.5),
        "ttft_p99_s": percentile([s.ttft_s for s in ok], 0.99),
        "wall_s": round(wall, 2),
        # per request in send order: [sent s, first token s, cached, prompt tokens] (what a p50 is made of)
        "per_request": [
            [round(s.sent_s, 3), round(s.ttft_s, 3), s.cached_tokens, s.prompt_tokens]
            for s in sorted(ok, key=lambda s: s.sent_s)
        ],
        **({"first_error": next(s.error for s in sents if s.error)} if len(ok) < len(sents) else {}),
    }


def warm(base: str, model: str, chat: bool) -> None:
    """One short request outside the measurement (first-call costs), on text no workload starts with."""
    stream(base, body_for(Item("Warm up.", ("Hi",), 2), [], 0, chat, model), time.perf_counter())


def forkline_run(
    name: str, loaded, work, chat: bool, prefix_flags: list[str], engine_flags: list[str]
) -> dict:
    tokenize, answer_ids = local_tokenizer(loaded)
    server = Forkline(name, engine_flags, prefix_flags)
    try:
        warm(server.base, name, chat)
        sents, wall = run_workload(server.base, work, chat, name)
        held = server.held(bytes_per_position(loaded.config))
    finally:
        server.close()
    out = summarize(sents, wall, tokenize, answer_ids, bytes_per_position(loaded.config)) | {"held": held}
    out["bytes_held_vs_ideal_radix"] = ratio(held.get("bytes_held"), out["ideal_radix_bytes"])
    return out


def llama_run(binary: str, name: str, loaded, work, chat: bool, threads: int) -> dict:
    from llama_server import LlamaServer

    from engine_service.model.loading.packaged import resolve_model

    with LlamaServer(binary, resolve_model(name), threads=threads, ctx=LLAMA_CTX, slots=4) as server:
        warm(server.base, "model", chat)
        sents, wall = run_workload(server.base, work, chat, "model")
        held = llama_held(server.base, bytes_per_position(loaded.config), LLAMA_CTX)
        tokenize, answer_ids = llama_tokenizer(server.base)
        return summarize(sents, wall, tokenize, answer_ids, bytes_per_position(loaded.config)) | {
            "held": held
        }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(mine: dict, theirs: dict) -> dict:
    return {
        "cached_share": ratio(mine["cached_share"], theirs["cached_share"]),
        "cached_share_vs_ideal": ratio(mine["cached_share"], mine["ideal_share"]),
        "ttft_p50": ratio(mine["ttft_p50_s"], theirs["ttft_p50_s"]),
        "ttft_p99": ratio(mine["ttft_p99_s"], theirs["ttft_p99_s"]),
        "wall": ratio(mine["wall_s"], theirs["wall_s"]),
    }


def log(what: object) -> None:
    print(json.dumps(what), file=sys.stderr, flush=True)


def run_model(name: str, args: argparse.Namespace) -> dict:
    from engine_service.model import load_model

    loaded = load_model(name)
    chat = name not in BASE_MODELS
    work = workloads(Words(loaded.tokenizer), args.seed, args.quick, tuple(args.workloads))
    out: dict = {"route": "/v1/chat/completions" if chat else "/v1/completions", "workloads": {}}
    for w in work:
        r: dict = {"shape": w.shape}
        r["forkline"] = forkline_run(name, loaded, w, chat, args.prefix_flags, args.engine_flags)
        log({name: {w.name: {"forkline": r["forkline"]}}})
        if args.llama_server:
            r["llama_server"] = llama_run(args.llama_server, name, loaded, w, chat, args.threads)
            r["ratios"] = ratios(r["forkline"], r["llama_server"])
            log({name: {w.name: {"llama_server": r["llama_server"], "ratios": r["ratios"]}}})
        out["workloads"][w.name] = r
    if args.sweep:
        out["sweep"] = sweep(name, loaded, work, chat, args)
    return out


def sweep(name: str, loaded, work, chat: bool, args: argparse.Namespace) -> dict:
    """forkline alone once per value of ``args.sweep``'s flag: cached share and TTFT per setting, and the
    pairs of settings where both rise (a larger budget that reuses more yet answers later)."""
    flag, _, values = args.sweep.partition("=")
    out: dict = {"flag": flag, "settings": {}, "ttft_rises_with_share": []}
    for value in values.split(","):
        flags = [*args.prefix_flags, f"--{flag.lstrip('-')}", value]
        row = {}
        for w in work:
            r = forkline_run(name, loaded, w, chat, flags, args.engine_flags)
            row[w.name] = {k: r[k] for k in ("cached_share", "ideal_share", "ttft_p50_s", "wall_s")}
            row[w.name]["bytes_held"] = r["held"].get("bytes_held")
        out["settings"][value] = row
        log({name: {"sweep": {value: row}}})
    settings = list(out["settings"].items())
    for w in (w.name for w in work):
        for i, (a, ra) in enumerate(settings):
            for b, rb in settings[i + 1 :]:
                lo, hi = (ra[w], rb[w]) if ra[w]["cached_share"] <= rb[w]["cached_share"] else (rb[w], ra[w])
                if hi["cached_share"] > lo["cached_share"] and hi["ttft_p50_s"] > lo["ttft_p50_s"]:
                    out["ttft_rises_with_share"].append({"workload": w, "settings": [a, b]})
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = report["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 8), squeeze=False)
    for col, (name, r) in enumerate(models.items()):
        names = list(r["workloads"])
        xs = range(len(names))
        top, bottom = axes[0][col], axes[1][col]
        series = [("forkline", "forkline"), ("llama_server", "llama-server")]
        for k, (key, label) in enumerate(series):
            top.bar([x + (k - 1) * 0.27 for x in xs], [r["workloads"][n].get(key, {}).get("cached_share", 0) for n in names], 0.27, label=label)  # fmt: skip
        top.bar(
            [x + 0.27 for x in xs],
            [r["workloads"][n]["forkline"]["ideal_share"] for n in names],
            0.27,
            label="ideal",
        )
        top.set_title(f"{name}: prompt tokens served from cache")
        for k, key in enumerate(("ttft_p50", "wall")):
            vals = [r["workloads"][n].get("ratios", {}).get(key) or 0 for n in names]
            bottom.bar([x + (k - 0.5) * 0.35 for x in xs], vals, 0.35, label=f"{key} forkline / llama-server")
        bottom.axhline(1.0, color="grey", lw=0.8)
        bottom.set_title(f"{name}: time ratios (< 1: forkline faster)")
        for ax in (top, bottom):
            ax.set_xticks(list(xs))
            ax.set_xticklabels(names, fontsize=8, rotation=15)
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", nargs="+", default=["smollm2", "gemma3"], help="smollm2, gemma3 (or full names)"
    )
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run of a few minutes)")
    parser.add_argument("--workloads", nargs="+", default=list(NAMES), choices=NAMES)
    parser.add_argument(
        "--out", default=os.path.join(HERE, "out", "bench_workloads.json"), help="JSON path (PNG beside it)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--llama_server", default=LLAMA_SERVER if os.path.exists(LLAMA_SERVER) else None, metavar="PATH"
    )
    parser.add_argument("--no_llama", action="store_true", help="forkline alone")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    parser.add_argument(
        "--sweep", default=None, metavar="FLAG=V1,V2", help="a prefix-service flag's values to sweep"
    )
    parser.add_argument("--prefix_flags", default="", help="extra forkline-prefix flags (one string)")
    parser.add_argument("--engine_flags", default="", help="extra forkline-engine flags (one string)")
    args = parser.parse_args()  # fmt: skip
    names = [ALIASES.get(m, m) for m in args.model]
    unknown = [m for m in names if m not in ALIASES.values()]
    if unknown:
        parser.error(f"--model: unknown {unknown}; choose from {sorted(ALIASES)}")
    if args.sweep and "=" not in args.sweep:
        parser.error("--sweep: expected FLAG=V1,V2,...")
    args.prefix_flags, args.engine_flags = shlex.split(args.prefix_flags), shlex.split(args.engine_flags)
    args.llama_server = None if args.no_llama else args.llama_server
    t0 = time.perf_counter()
    report: dict = {"load_average_1_5_15min": [round(x, 2) for x in os.getloadavg()], "quick": args.quick}
    report["servers"] = {"forkline": "engine + prefix service, default flags" + (f" + {args.prefix_flags} {args.engine_flags}" if args.prefix_flags or args.engine_flags else ""),
                         "llama_server": f"-np 4 -c {LLAMA_CTX} -t {args.threads}" if args.llama_server else None}  # fmt: skip
    report["models"] = {}
    for name in names:
        report["models"][name] = run_model(name, args)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(report, png)
    report["plot"] = os.path.relpath(png, ROOT)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
