"""Speculative decoding (``--speculative lookup``) against plain decoding, in one window (issue 38).

Tasks where drafts should pay -- quote a paragraph, fix a typo in a ~300-token code snippet, echo a JSON
document with one field changed, answer again after an edit (the earlier answer is in the prompt) --
and plain prose where they should not, through a Runner over the packaged model's chat template.
Each task runs plain and speculative, greedy and seeded sampling, one sequence and a batch (the
same task with different seeds / names), alternating, ``--repeats`` pairs; every speculative output
is compared with the plain one token for token. Reports decode tok/s (best of the repeats), the
ratio (the median of each pair's ratio, plain and speculative back to back, which goes first
alternating: on a shared host a pair sees one load; rows that draft nothing read 0.86-1.11x as best-of
ratios), drafted / accepted
tokens and the share of identical outputs. Prints JSON, writes --out and a PNG next to it.

    .venv/bin/python bench/bench_speculative.py [--models smollm2 gemma3] [--batch 4] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)

ALIASES = {"smollm2": "smollm2-135m", "gemma3": "gemma-3-270m"}

PARAGRAPH = (
    "The lighthouse stood on a spit of black rock at the mouth of the bay, and for ninety years its "
    "lamp had turned through every night without fail. The keepers came and went, each one leaving a "
    "line in the log: the weather, the ships that passed, the hour the lamp was lit and the hour it "
    "was put out. In the winter of the great storm the log records nothing for three days, and then a "
    "single sentence in a shaking hand: the light held."
)
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index + 1 >= window:
            averages.append(total / window)
    return averages


def normalise(values):
    """Scale values so that they sum to one."""
    total = sum(values)
    if total == 0:
        raise ValueError("cannot normalise values that sum to zero")
    return [value / totl for value in values]


def summary(values):
    """Mean, minimum and maximum of values."""
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
'''
DOCUMENT = {
    "id": 4182,
    "name": "Harbour survey",
    "status": "draft",
    "owner": {"name": "R. Alvarez", "team": "coastal"},
    "tags": ["tides", "charts", "soundings"],
    "points": [{"lat": 51.5, "lon": -3.2, "depth": 12.4}, {"lat": 51.6, "lon": -3.1, "depth": 9.8}],
}
ANSWER = (
    "A prefix cache keeps the attention keys and values of prompts it has seen, so that a new request "
    "which starts with the same tokens can skip computing them again. It pays when many requests share "
    "a long system prompt or a document, and it costs memory for every prefix it keeps."
)

TASKS = {
    "quote": f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "code_fix": f"This code has one typo. Write out the whole corrected code:\n\n```python\n{CODE}```",
    "json_echo": 'Return this JSON document unchanged except that status is "final":\n\n'
    + json.dumps(DOCUMENT, indent=2),
    "regenerate": f"Here is an earlier answer:\n\n{ANSWER}\n\nWrite it again, changing only 'memory' to "
    "'RAM'.",
    "prose": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


# a base model (no chat template) reads the task as a document: a cue where the answer starts, so it
# answers instead of ending the document (Gemma 3 270M stopped after 2 tokens on json_echo without one)
BASE_CUES = {
    "quote": "The paragraph, repeated word for word:\n\n",
    "code_fix": "The whole corrected code:\n\n```python\n",
    "json_echo": 'The same document with status "final":\n\n',
    "regenerate": "The answer again, with 'RAM' for 'memory':\n\n",
    "prose": "The story:\n\n",
}


def chat_ids(loaded, text: str, task: str = "") -> list[int]:
    """The task through the model's chat template; a base model (no template): the text and the task's
    answer cue after BOS."""
    from engine_service.api.prompts import TextPrompt, text_tokens

    chat = loaded.chat.available
    if not chat and task:
        text = f"{text}\n\n{BASE_CUES[task]}"
    prompt = TextPrompt(text, chat=chat, add_special_tokens=not chat)
    return list(text_tokens(prompt, loaded.tokenizer, loaded.chat))


def run_batch(runner, prompts: list[list[int]], configs) -> tuple[list[list[int]], float, int]:
    """Generate each prompt with its config at once: (outputs, decode tok/s over the batch, tokens)."""
    sessions = [runner.open_session() for _ in prompts]
    try:
        handles = [s.generate_async(p, c) for s, p, c in zip(sessions, prompts, configs, strict=True)]
        results = [h.wait(timeout=900) for h in handles]
    finally:
        for s in sessions:
            s.close()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    tokens = sum(len(r.tokens) for r in results)
    first = min(r.metrics.time_to_first_token_s or 0.0 for r in results)
    wall = max(r.metrics.total_s for r in results)
    return [list(r.tokens) for r in results], (tokens - len(results)) / max(1e-9, wall - first), tokens


def measure(
    name: str,
    new_tokens: int,
    batch: int,
    repeats: int,
    num_drafts: int,
    mode: str,
    tasks: list[str],
    rows_cap: int,
) -> dict:
    from engine_service.api.config import GenConfig
    from engine_service.executors.module import ModuleExecutor
    from engine_service.executors.prompt_lookup import PromptLookupExecutor
    from engine_service.model import load_model
    from engine_service.runtime.runner import Runner

    loaded = load_model(name)
    stops = tuple(loaded.config.eos_token_ids)
    kw = {"max_sessions": batch + 2, "max_session_tokens": 2048}
    plain_ex = ModuleExecutor.create(loaded, "batched-sequence", **kw)
    spec_ex = PromptLookupExecutor.create(
        loaded,
        "batched-sequence",
        num_drafts=num_drafts,
        suffix=mode == "suffix",
        max_draft_rows=rows_cap,
        **kw,
    )
    runners = {
        "plain": Runner(plain_ex, max_decode_sequences=8),
        "lookup": Runner(spec_ex, max_decode_sequences=8),
    }
    rows = []
    try:
        for runner in runners.values():  # warm-up
            run_batch(runner, [chat_ids(loaded, "Hi")], [GenConfig(max_new_tokens=4)])
        for task in tasks:
            ids = chat_ids(loaded, TASKS[task], task)
            for mode, temperature in (("greedy", 0.0), ("seeded", 0.7)):
                for width in (1, batch):
                    configs = [
                        GenConfig(
                            max_new_tokens=new_tokens, temperature=temperature, seed=s, stop_tokens=stops
                        )
                        for s in range(width)
                    ]
                    prompts = [ids] * width
                    best: dict[str, float] = {}
                    pairs: list[float] = []
                    outs: dict[str, list[list[int]]] = {}
                    drafted = accepted = 0
                    for repeat in range(repeats):
                        pair: dict[str, float] = {}
                        order = list(runners.items())  # alternating who goes first: no order bias
                        for way, runner in order if repeat % 2 == 0 else order[::-1]:
                            d0, a0 = spec_ex.drafted, spec_ex.accepted
                            out, tok_s, _ = run_batch(runner, prompts, configs)
                            best[way] = max(best.get(way, 0.0), tok_s)
                            pair[way] = tok_s
                            outs[way] = out
                            if way == "lookup":
                                drafted, accepted = spec_ex.drafted - d0, spec_ex.accepted - a0
                        pairs.append(pair["lookup"] / pair["plain"])
                    same = sum(a == b for a, b in zip(outs["plain"], outs["lookup"], strict=True))
                    row = {"task": task, "mode": mode, "sequences": width,
                           "plain_tok_s": round(best["plain"], 1), "lookup_tok_s": round(best["lookup"], 1),
                           "ratio": round(statistics.median(pairs), 3), "pair_ratios": [round(r, 3) for r in pairs],
                           "identical": f"{same}/{width}",
                           "drafted": drafted, "accepted": accepted,
                           "cost_ratio": round(spec_ex.step_costs.ratio, 2),
                           "tokens": sum(len(o) for o in outs["plain"])}  # fmt: skip
                    rows.append(row)
                    print(json.dumps({name: row}), file=sys.stderr, flush=True)
    finally:
        for runner in runners.values():
            runner.shutdown()
    prompts = {task: chat_ids(loaded, TASKS[task], task) for task in tasks}
    return {"num_drafts": num_drafts, "max_draft_rows": rows_cap, "new_tokens": new_tokens, "rows": rows,
            "prompts": prompts, "ring_slots": {"plain": ring_slots(plain_ex), "lookup": ring_slots(spec_ex)}}  # fmt: skip


def ring_slots(executor) -> int:
    """Slots of every sliding-window layer's ring per sequence (0 without rings): drafts must not grow it."""
    config = executor.cache.config
    return sum(config.ring_slots(spec.window) for spec in config.layers if spec.sliding)


def with_peer(report: dict, binary: str, new_tokens: int, repeats: int) -> None:
    """llama-server's n-gram types on each model's prompts (one sequence), and forkline over its best."""
    from speculative_peer import best_spec
    from speculative_peer import measure as peer_measure

    from engine_service.model.loading.packaged import resolve_model

    for name, r in report["models"].items():
        peer = peer_measure(binary, resolve_model(name), r.pop("prompts"), new_tokens, repeats)
        r["llama_server"] = peer
        for row in r["rows"]:
            if row["sequences"] != 1:
                continue
            spec, rate = best_spec(peer, row["task"], row["mode"])
            plain = peer.get("none", {}).get(row["task"], {}).get(row["mode"], {}).get("tok_s", 0.0)
            row["llama_best_spec"], row["llama_spec_tok_s"], row["llama_plain_tok_s"] = spec, rate, plain
            row["vs_llama_spec"] = round(row["lookup_tok_s"] / rate, 3) if rate else None


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models, strict=True):
        rows = report["models"][name]["rows"]
        labels = [f"{r['task']}\n{r['mode'][0]}{r['sequences']}" for r in rows]
        ax.bar(range(len(rows)), [r["ratio"] for r in rows])
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=6, rotation=60)
        ax.set_ylabel("lookup / plain decode tok/s")
        ax.set_title(name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--new_tokens", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num_drafts", type=int, default=4)
    parser.add_argument("--mode", choices=("lookup", "suffix"), default="lookup")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--max_draft_rows", type=int, default=8, help="draft rows per forward at most")
    parser.add_argument(
        "--llama_server", default=None, metavar="PATH", help="also llama-server's n-gram types"
    )
    parser.add_argument("--out", default=os.path.join(HERE, "out", "speculative.json"))
    args = parser.parse_args()
    report = {
        "load_average_1_5_15min": list(os.getloadavg()),
        "started": time.strftime("%H:%M"),
        "models": {},
    }
    for model in args.models:
        name = ALIASES.get(model, model)
        report["models"][name] = measure(
            name,
            args.new_tokens,
            args.batch,
            args.repeats,
            args.num_drafts,
            args.mode,
            args.tasks,
            args.max_draft_rows,
        )
        save(report, args.out + ".partial")  # a later model's failure keeps this one's rows
    if args.llama_server:
        with_peer(report, args.llama_server, args.new_tokens, args.repeats)
    for r in report["models"].values():
        r.pop("prompts", None)
    save(report, args.out)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
