"""A 10-turn tool-using agent conversation through both HTTP doors: each turn the user asks, a ``lookup``
tool call and its (~150-token) result follow, and the model answers; the context grows to ~3,000 tokens.
Four ways to send it, one server at a time, one window: forkline's ``/v1/responses`` chained with
``previous_response_id`` (each request carries only the turn's new items), forkline's
``/v1/chat/completions`` re-sending the whole conversation, and llama-server's ``/v1/responses`` and
``/v1/chat/completions`` (it refuses ``previous_response_id``: both re-send everything). Per way: TTFT of
every turn, the cached tokens the server reports, the total wall time; ratios forkline / llama-server.
Prints JSON, draws a PNG next to --out.

    .venv/bin/python bench/bench_agent_turns.py [--models smollm2] [--turns 10]
        [--llama_server PATH | --no_llama] [--out bench/out/agent_turns.json]

The tool call is the client's (a ``function_call`` item it replays, as an agent loop that ran the tool
does), so every server sees the same items whatever its model would have called; the answers are the
servers' own (greedy, 32 tokens at most).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_workloads import ALIASES, LLAMA_CTX, LLAMA_SERVER, ratio  # noqa: E402
from workload_client import http_client  # noqa: E402
from workload_servers import Forkline  # noqa: E402
from workload_shapes import Words  # noqa: E402

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)

ANSWER_TOKENS = 32
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a key up in the team's notes.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
}


class Turn(NamedTuple):
    question: str
    key: str
    result: str


class Reply(NamedTuple):
    ttft_s: float
    text: str
    cached: int | None
    prompt: int | None
    response_id: str = ""


def conversation(words: Words, turns: int, seed: int) -> tuple[str, list[Turn]]:
    rng = random.Random(seed)
    instructions = "You are a careful assistant with a lookup tool. " + words.text(rng, 300)
    return instructions, [
        Turn(f"Turn {k}: {words.text(rng, 40)}?", f"key{k}", words.text(rng, 150)) for k in range(turns)
    ]


def turn_items(k: int, turn: Turn) -> list[dict]:
    """The Responses items a turn adds before the model answers."""
    call_id = f"call_{k}"
    return [
        {"type": "message", "role": "user", "content": turn.question},
        {"type": "function_call", "call_id": call_id, "name": "lookup", "arguments": json.dumps({"key": turn.key})},
        {"type": "function_call_output", "call_id": call_id, "output": turn.result},
    ]  # fmt: skip


def turn_messages(k: int, turn: Turn) -> list[dict]:
    """The chat messages a turn adds before the model answers."""
    call_id = f"call_{k}"
    call = {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"key": turn.key})}}  # fmt: skip
    return [
        {"role": "user", "content": turn.question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": turn.result},
    ]


def sse(base: str, route: str, body: dict) -> tuple[float | None, list[dict]]:
    """POST ``body`` streamed; the first text delta's time and every event."""
    t0, first, events = time.perf_counter(), None, []
    with http_client().stream("POST", base + route, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{route}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            text = event.get("delta") if event.get("type") == "response.output_text.delta" else None
            if text is None and event.get("choices"):
                text = (event["choices"][0].get("delta") or {}).get("content")
            if text and first is None:
                first = time.perf_counter() - t0
    return first, events


def responses_turn(base: str, model: str, items: list[dict], instructions: str, previous: str) -> Reply:
    body = {"model": model, "input": items, "instructions": instructions, "tools": [TOOL], "tool_choice": "none",
            "max_output_tokens": ANSWER_TOKENS, "temperature": 0, "stream": True}  # fmt: skip
    if previous:
        body["previous_response_id"] = previous
    ttft, events = sse(base, "/v1/responses", body)
    ends = ("response.completed", "response.incomplete")  # incomplete: max_output_tokens reached
    done = next((e["response"] for e in events if e.get("type") in ends), {})
    text = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
    usage = done.get("usage") or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
    return Reply(ttft or 0.0, text, cached, usage.get("input_tokens"), done.get("id", ""))


def chat_turn(base: str, model: str, messages: list[dict]) -> Reply:
    tool = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
    body = {"model": model, "messages": messages, "tools": [tool], "tool_choice": "none", "max_tokens": ANSWER_TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    ttft, events = sse(base, "/v1/chat/completions", body)
    text = "".join(
        (e["choices"][0].get("delta") or {}).get("content") or "" for e in events if e.get("choices")
    )
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), {})
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return Reply(ttft or 0.0, text, cached, usage.get("prompt_tokens"))


def run_way(base: str, model: str, way: str, instructions: str, turns: list[Turn]) -> dict:
    """One conversation sent ``way``: chain (previous_response_id), responses (all items) or chat."""
    replies: list[Reply] = []
    items: list[dict] = []
    messages: list[dict] = [{"role": "system", "content": instructions}]
    t0 = time.perf_counter()
    for k, turn in enumerate(turns):
        if way == "chat":
            messages += turn_messages(k, turn)
            reply = chat_turn(base, model, messages)
            messages.append({"role": "assistant", "content": reply.text})
        elif way == "chain":
            previous = replies[-1].response_id if replies else ""
            reply = responses_turn(base, model, turn_items(k, turn), instructions, previous)
        else:
            items += turn_items(k, turn)
            reply = responses_turn(base, model, items, instructions, "")
            answer = [{"type": "output_text", "text": reply.text, "annotations": []}]
            items.append({"type": "message", "role": "assistant", "content": answer})
        replies.append(reply)
    wall = time.perf_counter() - t0
    ttfts = [r.ttft_s for r in replies]
    return {
        "ttft_s": [round(t, 4) for t in ttfts],
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        # flat: the last three turns' TTFT over turns 2-4's (turn 1 is cold everywhere)
        "ttft_growth": ratio(statistics.mean(ttfts[-3:]), statistics.mean(ttfts[1:4])),
        "prompt_tokens": [r.prompt for r in replies],
        "cached_tokens": [r.cached for r in replies],
        "wall_s": round(wall, 3),
    }


def run_model(name: str, args: argparse.Namespace) -> dict:
    from engine_service.model import load_model
    from engine_service.model.loading.packaged import resolve_model

    words = Words(load_model(name).tokenizer)
    instructions, turns = conversation(words, args.turns, args.seed)
    out: dict = {"forkline": {}}
    for way in ("chain", "chat"):  # a fresh server per way: nothing cached from the other
        server = Forkline(name)
        try:
            out["forkline"][way] = run_way(server.base, name, way, instructions, turns)
        finally:
            server.close()
    print(json.dumps({name: {"forkline": out["forkline"]}}), file=sys.stderr, flush=True)
    if args.llama_server:
        from llama_server import LlamaServer

        out["llama_server"] = {}
        for way in ("responses", "chat"):
            with LlamaServer(
                args.llama_server,
                resolve_model(name),
                threads=args.threads,
                ctx=LLAMA_CTX,
                slots=4,
                extra=["--jinja"],
            ) as s:
                out["llama_server"][way] = run_way(s.base, "model", way, instructions, turns)
        mine = out["forkline"]["chain"]
        out["ratios"] = {
            f"chain_vs_llama_{way}": {
                "wall": ratio(mine["wall_s"], theirs["wall_s"]),
                "ttft_p50": ratio(mine["ttft_p50_s"], theirs["ttft_p50_s"]),
            }
            for way, theirs in out["llama_server"].items()
        }
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["models"]), figsize=(7 * len(report["models"]), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], report["models"].items(), strict=True):
        for server, ways in r.items():
            if server == "ratios":
                continue
            for way, row in ways.items():
                ax.plot(range(1, len(row["ttft_s"]) + 1), [t * 1000 for t in row["ttft_s"]], marker="o",
                        label=f"{server} {way} (wall {row['wall_s']:.1f} s)")  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("turn")
        ax.set_ylabel("first token (ms)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument(
        "--llama_server", default=LLAMA_SERVER if os.path.exists(LLAMA_SERVER) else None, metavar="PATH"
    )
    parser.add_argument("--no_llama", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "agent_turns.json"))
    args = parser.parse_args()
    args.llama_server = None if args.no_llama else args.llama_server
    report = {"turns": args.turns, "answer_tokens": ANSWER_TOKENS, "models": {}}
    for model in args.models:
        name = ALIASES.get(model, model)
        report["models"][name] = run_model(name, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
