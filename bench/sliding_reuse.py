"""The sliding-window reuse case (issue 19 item 7), as ``bench_models.py --reuse`` runs it.

Gemma 3 270M (15 of 18 layers slide over 512 positions) behind a real ``forkline-engine`` and
``forkline-prefix`` (``--checkpoint_stride 256``, opt-in since issue 35): request A is a 1,440-token prompt, request B
shares A's first 864 tokens (60%) and then diverges. Measured per cache kind: B's reused positions and
time to first token through the gateway, against B computed cold (its own namespace, nothing cached);
and the same with checkpoints off (stride 0, ``--max_checkpoints 0``: on batched-sequence a ``window`` miss).
With ``llama_server``: llama.cpp's ``/completion`` (``cache_prompt: true``, 4 slots) on the same A then
B, reporting its ``timings.cache_n`` (positions reused) and ``prompt_ms``.
"""

from __future__ import annotations

import os
import random
import sys
import time

from engine_service.api.config import GenConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODEL = "gemma-3-270m"
PROMPT, SHARED = 1440, 864


def prompts(seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    a = [2] + [rng.randrange(300, 60000) for _ in range(PROMPT - 1)]
    b = a[:SHARED] + [rng.randrange(300, 60000) for _ in range(PROMPT - SHARED)]
    return a, b


def forkline(kind: str, stride: int, a: list[int], b: list[int]) -> dict:
    from clients.demo import Service
    from clients.prefix_client import PrefixClient

    engine = Service(
        "forkline-engine",
        [
            "engine_service",
            "--port",
            "0",
            "--model",
            MODEL,
            "--cache_kind",
            kind,
            "--max_sessions",
            "32",
            "--log_level",
            "WARNING",
        ],
    )
    try:
        prefix = Service(
            "forkline-prefix",
            [
                "prefix_service",
                "--engine",
                engine.address,
                "--port",
                "0",
                "--checkpoint_stride",
                str(stride),
                "--max_checkpoints",
                "8" if stride else "0",
                "--log_level",
                "WARNING",
            ],
        )
        try:
            client = PrefixClient(prefix.address, owner="bench", timeout=600)

            def ask(tokens: list[int], namespace: str) -> dict:
                t0 = time.perf_counter()
                out = client.generate(
                    tokens, namespace=namespace, config=GenConfig(max_new_tokens=1), timeout=600
                ).collect()
                return {
                    "reused": out.done.reused_positions,
                    "ttft_s": round(out.done.time_to_first_token_s, 3),
                    "wall_s": round(time.perf_counter() - t0, 3),
                    "token": list(out.tokens),
                }

            ask(a[:64], "warm")  # JIT-compiles the fused kernels: not measured
            ask(a, "shared")
            hit = ask(b, "shared")
            cold = ask(b, "cold")
            client.close_channel()
        finally:
            prefix.stop()
    finally:
        engine.stop()
    return {
        "cache_kind": kind,
        "checkpoint_stride": stride,
        "b_reused": hit["reused"],
        "b_ttft_s": hit["ttft_s"],
        "b_cold_ttft_s": cold["ttft_s"],
        "ttft_ratio_hit_vs_cold": round(hit["ttft_s"] / cold["ttft_s"], 3),
        "same_first_token_as_cold": hit["token"] == cold["token"],
    }


def llama_cpp(binary: str, threads: int, a: list[int], b: list[int]) -> dict:
    from llama_server import LlamaServer

    from engine_service.model.loading.packaged import resolve_model

    with LlamaServer(binary, resolve_model(MODEL), threads=threads, ctx=16384, slots=4) as server:
        out = {}
        for label, tokens in (("a", a), ("b", b)):
            r = server.post(
                "/completion",
                {"prompt": tokens, "n_predict": 1, "cache_prompt": True, "temperature": 0, "id_slot": 0},
            )
            t = r["timings"]
            out[label] = {
                "cache_n": t.get("cache_n"),
                "prompt_n": t.get("prompt_n"),
                "prompt_ms": round(t.get("prompt_ms", 0.0), 1),
            }
    return out


def run_reuse(llama_server: str | None, threads: int, *, quick: bool = False) -> dict:
    a, b = prompts()
    cases = [("batched-sequence", 256), ("batched-sequence", 0), ("batched-cell", 256)]
    if quick:
        cases = cases[:2]
    report = {
        "model": MODEL,
        "prompt_a": len(a),
        "prompt_b": len(b),
        "shared": SHARED,
        "window": 512,
        "forkline": [forkline(kind, stride, a, b) for kind, stride in cases],
    }
    if llama_server:
        report["llama_cpp"] = llama_cpp(llama_server, threads, a, b)
    return report
