"""What a snapshot move costs next to the prefill it saves, per position, on this machine.

``python bench/bench_moves.py [--positions 128 512 1024 2048] [--repeats 3]``: two engine processes of
the packaged SmolLM2 behind an in-process fleet (``connect_fleet``). For each prompt length N, in one
window: the cold time to first token of N random tokens on engine A (its prefill), the move of the
stored snapshot from A to B (``SnapshotMover``: ExportSession on A streamed into ImportSession on B,
verified and stored), and B's time to first token for the same prompt after the move (a hit). Prints
JSON (``bench/out/moves.json``) and draws ``bench/out/moves.png``; the fitted move overhead and
seconds per position are the defaults of ``prefix_service/fleet/rates.py`` (docs/ROUTING.md "Moves").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_service.api.call_context import CallContext  # noqa: E402
from engine_service.api.config import GenConfig  # noqa: E402
from engine_service.api.stream_events import Done, Tokens  # noqa: E402
from prefix_service.cache.index import token_key  # noqa: E402
from prefix_service.engines.connect import connect_fleet  # noqa: E402
from prefix_service.gateway.calls import GatewayRequest  # noqa: E402
from tests.service.test_engine_restart import ServiceProcess, free_port, wait_serving  # noqa: E402

OUT = ROOT / "bench" / "out"
OWNER = CallContext("bench")


class Engine(ServiceProcess):
    def __init__(self, max_tokens: int) -> None:
        self.port = free_port()
        super().__init__(
            "engine_service",
            "--port",
            str(self.port),
            "--max_sessions",
            "16",
            "--max_session_tokens",
            str(max_tokens),
        )

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def ttft(member, tokens: list[int]) -> tuple[float, Done]:
    """Seconds to the first token of a one-token gateway generation on ``member``, and its Done."""
    request = GatewayRequest("moves", tokens, GenConfig(max_new_tokens=1, temperature=0.0), ignore_eos=True)
    start, first, done = time.perf_counter(), None, None
    for event in member.gateway.generate(request, OWNER):
        if isinstance(event, Tokens) and first is None:
            first = time.perf_counter() - start
        if isinstance(event, Done):
            done = event
    assert first is not None and done is not None
    return first, done


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares seconds = a + b * positions."""
    xs, ys = [p for p, _ in points], [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.update(FORKLINE_KERNEL_THREADS="1", OPENBLAS_NUM_THREADS="1")  # two engines, two cores
    engines = [Engine(max(args.positions) + 8) for _ in range(2)]
    try:
        for engine in engines:
            wait_serving(engine, timeout=180)
        fleet, pool = connect_fleet(lambda: {e.address for e in engines}, max_entries=64, resolve_every_s=60)
        try:
            results = measure(fleet, args.positions, args.repeats)
        finally:
            pool.stop()
            for member in fleet.members():
                fleet.remove(member.name)
    finally:
        for engine in engines:
            engine.kill()
    OUT.mkdir(exist_ok=True)
    (OUT / "moves.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=1))
    plot(results, OUT / "moves.png")


def measure(fleet, positions: list[int], repeats: int) -> dict:
    a, b = sorted(fleet.members(), key=lambda m: m.name)
    rng = random.Random(0)
    ttft(a, [rng.randrange(100, 40000) for _ in range(64)])  # warm both engines up
    ttft(b, [rng.randrange(100, 40000) for _ in range(64)])
    samples = []
    for n in positions:
        for _ in range(repeats):
            tokens = [rng.randrange(100, 40000) for _ in range(n)]
            cold, _ = ttft(a, tokens)
            moved = fleet.mover.move(a, b, "moves", token_key(tokens), 0)
            assert moved.moved, moved
            hit, done = ttft(b, tokens)
            assert done.reused_positions == n - 1, done
            samples.append({"positions": n, "cold_s": cold, "move_s": moved.seconds, "hit_after_move_s": hit})
            print(json.dumps(samples[-1]), flush=True)
    by_n = {}
    for n in positions:
        mine = [s for s in samples if s["positions"] == n]
        cold = statistics.median(s["cold_s"] for s in mine)
        move = statistics.median(s["move_s"] for s in mine)
        hit = statistics.median(s["hit_after_move_s"] for s in mine)
        by_n[str(n)] = {
            "cold_ttft_s": round(cold, 4),
            "move_s": round(move, 4),
            "hit_after_move_ttft_s": round(hit, 4),
            "move_plus_hit_vs_cold": round((move + hit) / cold, 3),
            "prefill_s_per_position": round(cold / n, 6),
            "move_s_per_position": round(move / n, 7),
        }
    overhead, per_position = fit([(s["positions"], s["move_s"]) for s in samples])
    _, prefill_per_position = fit([(s["positions"], s["cold_s"]) for s in samples])
    return {
        "model": "smollm2-135m",
        "by_positions": by_n,
        "move_fit": {"overhead_s": round(max(0.0, overhead), 4), "s_per_position": round(per_position, 8)},
        "prefill_fit_s_per_position": round(prefill_per_position, 6),
        "move_vs_prefill_per_position": round(per_position / prefill_per_position, 4),
        "samples": samples,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [int(n) for n in results["by_positions"]]
    rows = results["by_positions"].values()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [r["cold_ttft_s"] for r in rows], marker="o", label="cold prefill (TTFT)")
    ax.plot(ns, [r["move_s"] for r in rows], marker="o", label="move A -> B")
    ax.plot(ns, [r["move_s"] + r["hit_after_move_ttft_s"] for r in rows], marker="o", label="move + hit TTFT")
    ax.set_xlabel("prompt positions")
    ax.set_ylabel("seconds")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(
        f"forkline moves vs prefill (SmolLM2): move/prefill per position {results['move_vs_prefill_per_position']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
