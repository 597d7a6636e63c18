"""The prefix service's snapshot directory through the services: time to first token of a repeated
1,024- and 2,048-token prompt through the gateway cold, as a hot hit, and after an engine restart
served from the snapshot directory (a real engine server and prefix service on 127.0.0.1, the
packaged SmolLM2-135M, float32 K/V on the CPU).

Per length: a cold gateway Generate (a fresh namespace: nothing stored), a hot hit (the same prompt
again: the stored snapshot, the last token replayed), then the engine server is stopped and a new one
(a new Runner: every session gone, the model object reused as a restarted process would load it)
starts on the same port, and the same prompt is sent again: the prefix service loads the file into
the new engine (ExportSession's file, streamed back with ImportSession: read, checksum, content,
header checks, import) and hits it. TTFT is timed at the client, from the call to the first token.
Also the file's size per position and the restore's throughput (file bytes / (restored - hot TTFT)).

Target (issue 14): restored TTFT <= 1/10 of cold at 2,048 tokens.
Prints JSON, writes bench/out/bench_snapshot_dir.json and bench/out/bench_snapshot_dir.png.
Usage: .venv/bin/python bench/bench_snapshot_dir.py [--lengths 1024 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import engine_service  # noqa: F401  (loads OpenBLAS before mlx)
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.executors.options import ExecutorSettings
from engine_service.model.loading.loader import load_model
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import create_server as create_prefix_server
from prefix_service.tier.persistent_tier import PersistentTier

OUT = Path(__file__).resolve().parent / "out"


def engine_server(loaded, port: int = 0):
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name=os.path.basename(loaded.path),
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=16, max_session_tokens=4096),
        sessions=UNLIMITED,
    )
    return create_server(deps, f"127.0.0.1:{port}")


def ttft(client: PrefixClient, tokens: list[int], namespace: str) -> tuple[float, int]:
    """Seconds from the call to the first token, and the positions reused."""
    start = time.perf_counter()
    first = None
    stream = client.generate(
        tokens, namespace=namespace, config=GenConfig(max_new_tokens=2, temperature=0.0), ignore_eos=True
    )
    for event in stream:
        if first is None and getattr(event, "ids", None):
            first = time.perf_counter() - start
        done = event
    return first or 0.0, done.reused_positions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    loaded = load_model()
    vocab = loaded.tokenizer.vocab_size if hasattr(loaded.tokenizer, "vocab_size") else 49152
    rng = random.Random(0)
    results: dict = {"model": os.path.basename(loaded.path), "lengths": {}}
    folder = tempfile.mkdtemp(prefix="forkline-bench-snap-")
    engine, port = engine_server(loaded)
    tier = PersistentTier.open(folder, 8 << 30)
    gateway, channel = connect_engine(f"127.0.0.1:{port}", max_entries=16, tier=tier, engine_share=1.0)
    prefix, prefix_port = create_prefix_server(gateway, "127.0.0.1:0", channel=channel)
    client = PrefixClient(f"127.0.0.1:{prefix_port}", owner="bench")
    try:
        ttft(client, [rng.randrange(100, vocab) for _ in range(64)], "warmup")
        for length in args.lengths:
            runs: dict[str, list[float]] = {"cold": [], "hot": [], "restored": []}
            for r in range(args.repeats):
                prompt = [rng.randrange(100, vocab) for _ in range(length)]
                namespace = f"n{length}-{r}"
                cold, reused = ttft(client, prompt, namespace)
                assert reused == 0
                hot, reused = ttft(client, prompt, namespace)
                assert reused == length - 1, reused
                assert tier.writer.flush(60)
                engine.stop(0, shutdown_runner=True)  # the restart: every session of this engine is gone
                engine, _ = engine_server(loaded, port)
                restored, reused = ttft(client, prompt, namespace)
                assert reused == length - 1, f"not restored from disk: reused {reused}"
                runs["cold"].append(cold)
                runs["hot"].append(hot)
                runs["restored"].append(restored)
            disk = tier.store.stats()
            per_file = disk.bytes / max(1, disk.files)
            med = {k: statistics.median(v) for k, v in runs.items()}
            results["lengths"][str(length)] = {
                "ttft_s": {k: round(v, 4) for k, v in med.items()},
                "runs_s": {k: [round(x, 4) for x in v] for k, v in runs.items()},
                "restored_over_cold": round(med["restored"] / med["cold"], 4),
                "hot_over_cold": round(med["hot"] / med["cold"], 4),
                "restore_mb_per_s": round(per_file / 2**20 / max(1e-6, med["restored"] - med["hot"]), 1),
            }
        disk = tier.store.stats()
        results["snapshot_dir"] = {
            "files": disk.files,
            "bytes": disk.bytes,
            "written": disk.written,
            "restored": disk.restored,
        }
        total_positions = sum(int(n) * args.repeats for n in results["lengths"])
        results["bytes_per_position"] = round(disk.bytes / max(1, total_positions))
    finally:
        client.close_channel()
        prefix.stop(0)
        engine.stop(0, shutdown_runner=True)
    print(json.dumps(results, indent=2))
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_snapshot_dir.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / "bench_snapshot_dir.png")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(results["lengths"])
    kinds = ("cold", "restored", "hot")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.25
    for i, kind in enumerate(kinds):
        values = [results["lengths"][n]["ttft_s"][kind] for n in lengths]
        ax.bar([j + (i - 1) * width for j in range(len(lengths))], values, width, label=kind)
    ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token through the gateway (s, log)")
    ratios = ", ".join(f"{n}: restored/cold {results['lengths'][n]['restored_over_cold']}" for n in lengths)
    ax.set_title(f"snapshot directory after an engine restart ({ratios})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
