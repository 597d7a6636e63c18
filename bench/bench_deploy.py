"""The numbers deploy/k8s is sized from (docs/DEPLOY.md "Where the numbers come from"), measured on a real
``forkline-engine`` process with the manifests' engine flags (the packaged SmolLM2-135M, --kv_dtype auto):

- start: process start -> "listening" (model load and warm-up), seconds;
- idle RSS after one short generation, and the K/V bytes per position: sessions of ``--depth``
  positions are kept (keep_session) in steps, the RSS read from /proc after each step; bytes per
  position is the least-squares slope of RSS over kept positions;
- decode: tokens per second per sequence with 1 and ``--concurrency`` sequences decoding together from
  a ``--depth``-position prompt (the slowest point of a max_session_tokens generation: the deepest);
  the longest admissible generation (max_session_tokens new tokens) at that rate is what the drain
  grace must cover;
- drain: SIGTERM with ``--concurrency`` kept sessions and one stream running -> the stream's done
  event and the process's exit, seconds.

Prints JSON, writes bench/out/bench_deploy.json and bench/out/bench_deploy.png.
Usage: .venv/bin/python bench/bench_deploy.py [--depth 2040] [--steps 2 4 6 8] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine_service.api.config import GenConfig

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
ENGINE_FLAGS = ("--max_sessions", "32", "--max_session_tokens", "2048", "--kv_dtype", "auto")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_engine(*extra: str) -> tuple[subprocess.Popen, str, float]:
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine_service", "--port", "0", "--owner_max_sessions", "0",
         "--owner_max_positions", "0", *ENGINE_FLAGS, *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if " listening on " in line:
            address = line.rsplit(" ", 1)[1].strip()
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, address, time.monotonic() - started
    raise RuntimeError("the engine did not start")


def prompt(n: int, salt: int) -> list[int]:
    return [100 + (salt * 7919 + i * 31) % 40000 for i in range(n)]


def decode_rate(client, depth: int, concurrency: int, new_tokens: int) -> tuple[float, float]:
    """Steady decode with ``concurrency`` sequences from ``depth``-token prompts: (tokens per second
    per sequence, all sequences together), over the window in which every sequence decodes (after the
    last one's prefill, before the first one ends)."""
    stamps: list[list[float]] = [[] for _ in range(concurrency)]

    def one(i: int) -> None:
        stream = client.generate(prompt(depth, 1000 + i), config=GenConfig(max_new_tokens=new_tokens, temperature=0.0), ignore_eos=True)  # fmt: skip
        for event in stream:
            ids = getattr(event, "ids", None)
            if ids:
                stamps[i].extend([time.monotonic()] * len(ids))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each stream's own decode rate (after its first token: prefill excluded), averaged: how long a
    # stream of N tokens takes while the others decode too
    per_sequence = sum((len(s) - 2) / (s[-1] - s[1]) for s in stamps) / concurrency
    start, end = max(s[1] for s in stamps), min(s[-1] for s in stamps)
    together = (
        sum(sum(1 for t in s if start <= t <= end) for s in stamps) / (end - start) if end > start else 0.0
    )
    return per_sequence, together


def save(result: dict) -> None:
    """What is measured so far (a long run that fails later keeps it)."""
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_deploy.partial.json").write_text(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=2040)
    parser.add_argument("--steps", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--skip_memory", action="store_true", help="decode rates and the drain only")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args()
    from clients.engine_client import EngineClient

    result: dict = {"cpus": os.cpu_count(), "engine_flags": list(ENGINE_FLAGS), "depth": args.depth}
    proc, address, result["start_s"] = start_engine()
    client = EngineClient(address, owner="bench", timeout=600)
    try:
        info = client.info()
        result["compute_path"] = getattr(info, "compute_path", "")
        client.generate(prompt(16, 0), config=GenConfig(max_new_tokens=4), ignore_eos=True).collect()
        time.sleep(1.0)
        idle = rss_bytes(proc.pid)
        result["idle_rss_bytes"] = idle
        save(result)
        kept, points = 0, [(0, idle)]
        for step in [] if args.skip_memory else args.steps:
            while kept < step:
                client.generate(
                    prompt(args.depth, kept), config=GenConfig(max_new_tokens=1), keep_session=True
                ).collect()
                kept += 1
            time.sleep(0.5)
            points.append((kept * (args.depth + 1), rss_bytes(proc.pid)))
        if len(points) > 2:
            n = len(points)
            mx_, my = sum(p for p, _ in points) / n, sum(r for _, r in points) / n
            slope = sum((p - mx_) * (r - my) for p, r in points) / sum((p - mx_) ** 2 for p, _ in points)
            result["rss_points"] = points
            result["bytes_per_position"] = slope  # with the first step's one-time allocations
            kept_points = points[1:]  # the marginal cost once the first sessions set up the pools
            result["bytes_per_position_marginal"] = (kept_points[-1][1] - kept_points[0][1]) / (
                kept_points[-1][0] - kept_points[0][0]
            )
        deep = 2048 - args.new_tokens - 8  # the deepest decode a max_session_tokens session runs
        result["decode_depth"] = deep
        result["rate_1"] = decode_rate(client, deep, 1, args.new_tokens)[0]
        save(result)
        result["rate_n"], result["rate_n_total"] = decode_rate(
            client, deep, args.concurrency, args.new_tokens
        )
        result["concurrency"] = args.concurrency
        result["longest_generation_s"] = 2048 / result["rate_n"]
        result["heartbeat_longest_s"] = getattr(client.info(), "heartbeat_longest_s", None)
        save(result)
        # drain: one stream running, then SIGTERM
        done_at: list[float] = []

        def stream() -> None:
            for event in client.generate(
                prompt(64, 99), config=GenConfig(max_new_tokens=64), ignore_eos=True
            ):
                if type(event).__name__ == "Done":
                    done_at.append(time.monotonic())

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        proc.wait(120)
        result["drain_stream_done_s"] = (done_at[0] - sent) if done_at else None
        result["drain_exit_s"] = time.monotonic() - sent
    finally:
        client.close_channel()
        if proc.poll() is None:
            proc.kill()
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_deploy.json").write_text(json.dumps(result, indent=2))
    try:
        if "rss_points" not in result:
            raise ImportError("no memory points to plot")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs, ys = zip(*result["rss_points"], strict=True)
        plt.plot(xs, [y / 2**20 for y in ys], "o-")
        plt.xlabel("kept positions")
        plt.ylabel("engine RSS (MiB)")
        plt.title(f"{result['bytes_per_position']:.0f} bytes per position")
        plt.savefig(OUT / "bench_deploy.png", dpi=100)
    except ImportError:
        pass
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
