"""llama-server's n-gram speculative decoding on the same prompts (``bench_speculative.py --llama_server``):
one server per ``--spec-type`` (and one without), each task's prompt ids sent to ``/completion``
(greedy, and seeded at the same temperature), one sequence; its decode rate (``timings``) and drafts."""

from __future__ import annotations

from llama_server import LlamaServer

SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def completion(server: LlamaServer, ids: list[int], new_tokens: int, temperature: float) -> dict:
    body = {"prompt": ids, "n_predict": new_tokens, "temperature": temperature, "seed": 0,
            "cache_prompt": False, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # fmt: skip
    timings = server.post("/completion", body)["timings"]
    return {
        "tok_s": round(float(timings.get("predicted_per_second", 0.0)), 1),
        "tokens": int(timings.get("predicted_n", 0)),
        "drafted": int(timings.get("draft_n", 0)),
        "accepted": int(timings.get("draft_n_accepted", 0)),
    }


def measure(
    binary: str, model_path: str, prompts: dict[str, list[int]], new_tokens: int, repeats: int
) -> dict:
    """{spec type: {task: {mode: best of ``repeats``}}}; a type this build refuses is reported as such."""
    out: dict = {}
    for spec in SPEC_TYPES:
        extra = () if spec == "none" else ("--spec-type", spec)
        try:
            server = LlamaServer(binary, model_path, ctx=4096, slots=1, extra=extra)
        except RuntimeError as exc:
            out[spec] = {"error": str(exc)[:200]}
            continue
        with server:
            completion(server, prompts[next(iter(prompts))][:16], 4, 0.0)  # warm-up
            rows: dict = {}
            for task, ids in prompts.items():
                for mode, temperature in (("greedy", 0.0), ("seeded", 0.7)):
                    runs = [completion(server, ids, new_tokens, temperature) for _ in range(repeats)]
                    rows.setdefault(task, {})[mode] = max(runs, key=lambda r: r["tok_s"])
            out[spec] = rows
    return out


def best_spec(peer: dict, task: str, mode: str) -> tuple[str, float]:
    """The fastest n-gram type on ``task`` / ``mode`` and its tok/s."""
    rates = [
        (spec, rows[task][mode]["tok_s"])
        for spec, rows in peer.items()
        if spec != "none" and "error" not in rows
    ]
    return max(rates, key=lambda r: r[1]) if rates else ("", 0.0)
