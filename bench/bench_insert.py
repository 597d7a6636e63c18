"""Verified inserts: the cost of inserting a 2,000-token snapshot, and the share of it spent verifying
that the snapshot holds the tokens (content digests), measured in one run.

Both paths store a snapshot of a session holding 2,000 prompt tokens (tiny seeded model: the model's
size does not change an insert, which never runs a forward):

1. in-process: ``PrefixCache.insert`` over ``RunnerBackend`` of a clone taken beforehand (the
   CLI's ``capture.collect`` path: the capture clones during the generation, so the clone is not part
   of the insert). Verification: hashing the key's tokens + the runner's digest of the snapshot's
   recorded content.
2. services: the ``PrefixCache.Insert`` RPC (real engine and prefix servers on 127.0.0.1), timed at
   the client. Verification: the gateway's hash of the tokens + the engine's check of the clone's
   content (the cache then compares the reported digest: a bytes comparison).

Verification time is measured inside the very inserts (the digest functions are wrapped with timers),
so share = verification time / insert time per insert (median over the repeats). Each insert stores a
new entry (a fresh namespace), so the clone and the index insertion are included.

Prints JSON, writes bench/out/bench_insert.json and bench/out/bench_insert.png.

Usage: .venv/bin/python bench/bench_insert.py [--repeats 30] [--tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from clients.runner_backend import RunnerBackend
from engine_service.api import content as content_module
from engine_service.api.config import GenConfig
from engine_service.executors.module import ModuleExecutor
from engine_service.model.random_init import random_model
from engine_service.runtime.content_log import ContentLog
from engine_service.runtime.runner import Runner
from prefix_service.cache import admission as cache_module
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway import insert_flow as insert_flow_module

OUT = Path(__file__).resolve().parent / "out"


class HashTimer:
    """Wraps every content-digest function the insert paths call; ``spent`` sums their seconds."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: object, name: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, real))

    def __enter__(self) -> HashTimer:
        self.wrap(insert_flow_module, "content_digest")  # the insert flow's one hash of the tokens
        self.wrap(cache_module, "content_digest")  # the cache's, when no digest was passed
        self.wrap(ContentLog, "digest")  # the engine's record (clone check, snapshot digest)
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()


def summary(rows: list[tuple[float, float]]) -> dict:
    inserts = [total for total, _ in rows]
    shares = [hashed / total for total, hashed in rows]
    return {
        "insert_ms_median": statistics.median(inserts) * 1e3,
        "insert_ms_p90": sorted(inserts)[int(0.9 * (len(inserts) - 1))] * 1e3,
        "verification_ms_median": statistics.median(hashed for _, hashed in rows) * 1e3,
        "verification_share_median": statistics.median(shares),
        "inserts": len(rows),
    }


def in_process(tokens: list[int], repeats: int) -> dict:
    executor = ModuleExecutor.create(
        random_model("FFFF", 4, 0),
        "batched-sequence",
        max_sessions=repeats + 4,
        max_session_tokens=len(tokens) + 64,
        prefill_chunk=512,
    )
    runner = Runner(executor)
    cache = PrefixCache(RunnerBackend(runner), max_entries=repeats + 1)
    rows = []
    try:
        source = runner.open_session()
        source.generate_async(tokens, GenConfig(max_new_tokens=1)).wait(600)
        for i in range(repeats):
            snapshot = source.clone_async(len(tokens)).result(60)
            runner.flush(60)  # the engine thread idle again: the insert alone is timed
            with HashTimer() as timer:
                start = time.perf_counter()
                outcome = cache.insert(f"ns{i}", tokens, snapshot)
                total = time.perf_counter() - start
            assert outcome.stored, outcome
            rows.append((total, timer.spent))
    finally:
        cache.clear()
        runner.shutdown()
    return summary(rows)


def services(tokens: list[int], repeats: int) -> dict:
    from clients.engine_client import EngineClient
    from clients.prefix_client import PrefixClient

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' tiny-model servers
    from tests.service.conftest import start_engine, start_prefix

    engine = start_engine(max_sessions=repeats + 8, max_session_tokens=len(tokens) + 64, layers="FFFF")
    prefix = start_prefix(engine.address, max_entries=repeats + 1)
    rows = []
    try:
        owner = EngineClient(engine.address, owner="bench")
        session = owner.generate(tokens, max_new_tokens=1, keep_session=True).collect().started.session
        client = PrefixClient(prefix.address, owner="bench")
        client.insert_detailed(tokens, session, namespace="warm-up")  # channels and code paths warm
        for i in range(repeats):
            with HashTimer() as timer:
                start = time.perf_counter()
                result = client.insert_detailed(tokens, session, namespace=f"ns{i}")
                total = time.perf_counter() - start
            assert result.stored, result
            rows.append((total, timer.spent))
    finally:
        prefix.stop(0)
        engine.stop(0)
    return summary(rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["in-process", "services (Insert RPC)"]
    keys = ["in_process", "services"]
    inserts = [result[k]["insert_ms_median"] for k in keys]
    verify = [result[k]["verification_ms_median"] for k in keys]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.bar(names, inserts, color="#9ab", label="insert (median)")
    ax.bar(names, verify, color="#c44", label="of which: content verification")
    for x, (total, part) in enumerate(zip(inserts, verify, strict=True)):
        ax.text(x, total, f"{total:.2f} ms\nverify {100 * part / total:.1f}%", ha="center", va="bottom")
    ax.set_ylabel("ms")
    ax.set_title(f"Insert of a {result['tokens']}-token snapshot")
    ax.set_ylim(0, max(inserts) * 1.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="positions the snapshot holds")
    parser.add_argument("--repeats", type=int, default=30, help="inserts per path")
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(3, 128) for _ in range(args.tokens)]
    # the pure cost of one digest of the tokens, for scale
    start = time.perf_counter()
    for _ in range(200):
        content_module.content_digest(tokens)
    digest_us = (time.perf_counter() - start) / 200 * 1e6
    result = {
        "tokens": args.tokens,
        "content_digest_of_token_list_us": digest_us,
        "in_process": in_process(tokens, args.repeats),
        "services": services(tokens, args.repeats),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_insert.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, OUT / "bench_insert.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
