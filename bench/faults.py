"""The fault campaign (docs/RESUME.md): real processes of the tests' tiny engine (forwards slowed so a
stream lasts) behind a prefix service, one fault class at a time, many trials each at random points,
every output compared with a cold run of the same request on an engine's own Generate. Classes:

- ``kill_prefill`` / ``kill_decode``: ``kill -9`` of the serving engine of two, once the stream started
  (before its first token) or at a random token; the stream resumes on the other engine;
- ``sigstop``: SIGSTOP of the serving engine for 5 s at a random token, then SIGCONT;
- ``kill_export`` / ``kill_import``: a split fleet (``--role prefill`` and ``decode``), the prefill engine
  killed while the hand-off exports the prompt's snapshot, or the decode engine while it imports it;
- ``kv_dtype_swap``: the engine restarted on its port with the other K/V dtype after a prompt was
  stored in memory and on disk; nothing stored before may serve it;
- ``evict_race``: 4 clients at once over prompts sharing heads, a cache of 2 entries, so stores race
  evictions of the same entries;
- ``disk_full``: every snapshot file write fails (the prefix service's files capped at 4 KiB, as a
  full disk fails them); the service keeps serving from memory;
- ``bitflip`` / ``truncate``: a stored snapshot file damaged while the prefix service is down; its
  restart must refuse the file and recompute;
- ``dns_gone``: the DNS answer for the serving engine goes away mid-stream (its record removed, the
  server failing, or the record removed and the engine killed; ``fault_dns.py``);
- ``prefix_kill``: ``kill -9`` of the prefix service mid-stream (the client sees UNAVAILABLE: not
  survivable by design), restarted over the same snapshot directory; the request again.

Per class: trials, outputs equal to the cold run, how each trial ended (resumed, paused, refused
file, client error then retried), and every stream's reused positions (what ``cached_tokens`` reports)
against the longest prefix of its ids that any earlier stream of the class had computed (an upper
bound from the token ids alone: a count above it would claim reuse that never happened). Prints JSON, draws a PNG next to --out.

    .venv/bin/python bench/faults.py [--trials 10] [--classes ...] [--out bench/out/faults.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from fault_dns import dns_gone  # noqa: E402
from fault_rig import LEDGER, STEP_S, Rig, cold, plot, random_prompt, streamed, tiny_engine  # noqa: E402
from workload_servers import Process  # noqa: E402

from engine_service.api.config import GenConfig  # noqa: E402
from engine_service.api.errors import ForklineError  # noqa: E402
from engine_service.api.stream_events import Started  # noqa: E402
from protos import prefix_pb2  # noqa: E402

NEW_TOKENS = 60
CLASSES = (
    "kill_prefill", "kill_decode", "sigstop", "kill_export", "kill_import", "bitflip", "truncate",
    "prefix_kill", "kv_dtype_swap", "evict_race", "disk_full", "dns_gone",
)  # fmt: skip


def engine_faults(kind: str, trials: int, rng: random.Random) -> list[dict]:
    rig = Rig(2)
    rows = []
    try:
        client = rig.client()
        rig.routable(client, 2)
        for trial in range(trials):
            prompt = random_prompt(rng)
            config = GenConfig(max_new_tokens=NEW_TOKENS, temperature=rng.choice([0.0, 1.0]), seed=trial)
            reference = cold(rig.ports[0], prompt, config)
            point = rng.randrange(1, NEW_TOKENS - 5)
            fired: list[int] = []

            def fault(event, tokens, point=point, fired=fired) -> None:
                due = isinstance(event, Started) if kind == "kill_prefill" else len(tokens) >= point
                if fired or not due:
                    return
                port = rig.serving(client)
                fired.append(port)
                if kind == "sigstop":
                    proc = rig.engines[port].proc
                    proc.send_signal(signal.SIGSTOP)
                    threading.Timer(5.0, proc.send_signal, (signal.SIGCONT,)).start()
                else:
                    rig.engines[port].proc.kill()

            started = time.perf_counter()
            tokens, done = streamed(client, prompt, config, fault)
            rows.append({"exact": tokens == reference, "ended": "resumed" if done.resumes else "paused",
                         "resumes": done.resumes, "recomputed": done.resumed_positions,
                         "pause_s": round(done.resume_pause_s, 3), "seconds": round(time.perf_counter() - started, 3)})  # fmt: skip
            if kind != "sigstop" and fired:
                rig.restart_engine(fired[0])
                rig.routable(client, 2)
        client.close_channel()
    finally:
        rig.stop()
    return rows


def handoff_faults(kind: str, trials: int, rng: random.Random) -> list[dict]:
    """A split fleet (a prefill and a decode engine): the prefill engine killed as the hand-off exports
    its prompt snapshot (``kill_export``), or the decode engine as it imports it (``kill_import``), at a
    random moment within 60 ms of the first token."""
    rig = Rig(2, roles=("prefill", "decode"))
    prefill, decode = rig.ports
    victim = prefill if kind == "kill_export" else decode
    rows = []
    try:
        client = rig.client()
        rig.routable(client, 2)
        for trial in range(trials):
            prompt = random_prompt(rng)
            config = GenConfig(max_new_tokens=NEW_TOKENS, temperature=rng.choice([0.0, 1.0]), seed=trial)
            survivor = decode if victim == prefill else prefill
            reference = cold(survivor, prompt, config)
            delay = rng.uniform(0.0, 0.06)
            timers: list[threading.Timer] = []

            def fault(event, tokens, delay=delay, timers=timers) -> None:
                if tokens and not timers:
                    timers.append(threading.Timer(delay, rig.engines[victim].proc.kill))
                    timers[0].start()

            tokens, done = streamed(client, prompt, config, fault)
            timers[0].join()
            ended = (
                "resumed"
                if done.resumes
                else "handed_off"
                if done.engine.endswith(f":{decode}")
                else "kept_local"
            )
            rows.append({"exact": tokens == reference, "ended": ended, "delay_s": round(delay, 3)})
            rig.engines[victim].proc.wait(30)
            rig.restart_engine(victim)
            rig.routable(client, 2)
        client.close_channel()
    finally:
        rig.stop()
    return rows


def file_faults(kind: str, trials: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(trials):
        folder = tempfile.mkdtemp(prefix="forkline-faults-")
        rig = Rig(1, folder)
        try:
            client = rig.client()
            prompt = random_prompt(rng)
            config = GenConfig(max_new_tokens=8, temperature=0.0)
            streamed(client, prompt, config, lambda e, t: None)
            files = []
            deadline = time.monotonic() + 30
            while not files and time.monotonic() < deadline:  # the write-behind writer
                files = sorted(Path(folder).glob("*.safetensors"))
                time.sleep(0.1)
            client.close_channel()
            rig.prefix.proc.kill()
            rig.prefix.proc.wait(30)
            data = bytearray(files[0].read_bytes())
            if kind == "bitflip":
                data[rng.randrange(len(data) // 2, len(data))] ^= 1 << rng.randrange(8)
            else:
                data = data[: rng.randrange(16, len(data) - 1)]
            files[0].write_bytes(bytes(data))
            rig.prefix = rig._prefix()  # releases what the killed instance held in the engine
            client = rig.client()
            question = prompt + [ord("?")]
            tokens, done = streamed(client, question, config, lambda e, t: None)
            disk = client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).snapshot_dir
            ended = (
                "refused_file"
                if disk.refused or disk.discarded
                else "restored"
                if disk.restored
                else "recomputed"
            )
            rows.append({"exact": tokens == cold(rig.ports[0], question, config), "ended": ended,
                         "reused": done.reused_positions})  # fmt: skip
            client.close_channel()
        finally:
            rig.stop()
            shutil.rmtree(folder, ignore_errors=True)
    return rows


def kv_dtype_swap(trials: int, rng: random.Random) -> list[dict]:
    """The engine restarted on its port with the other K/V dtype (float16 <-> float32) after a prompt
    was stored in memory and on disk: the old entries must never serve the new engine."""
    folder = tempfile.mkdtemp(prefix="forkline-faults-")
    rig = Rig(1, folder)
    port = rig.ports[0]
    dtypes = ["float16", "float32"]
    rows = []
    try:
        for trial in range(trials):
            client = rig.client()
            rig.routable(client, 1)
            prompt = random_prompt(rng)
            config = GenConfig(max_new_tokens=16, temperature=0.0)
            streamed(client, prompt, config, lambda e, t: None)
            time.sleep(0.5)  # the write-behind writer
            rig.engines[port].proc.kill()
            rig.engines[port].proc.wait(30)
            rig.engines[port] = tiny_engine(port, kv_dtype=dtypes[(trial + 1) % 2])
            rig.routable(client, 1)
            question = prompt + [ord("?")]
            tokens, done = streamed(client, question, config, lambda e, t: None)
            ended = "recomputed" if done.reused_positions == 0 else "reused"
            rows.append({"exact": tokens == cold(port, question, config), "ended": ended})
            client.close_channel()
    finally:
        rig.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def evict_race(trials: int, rng: random.Random) -> list[dict]:
    """Stores racing evictions of the same entries: 4 clients at once over 6 prompts sharing heads, a
    cache of 2 entries; each trial one round of 24 requests, every output against its cold run."""
    rig = Rig(1)
    rig.prefix.stop()
    addresses = ["--engine", f"127.0.0.1:{rig.ports[0]}"]
    rig.prefix = Process(
        ["prefix_service", *addresses, "--port", str(rig.prefix_port), "--max_entries", "2"], ["grpc"]
    )
    heads = [[rng.randrange(65, 91) for _ in range(60)] for _ in range(2)]
    prompts = [heads[i % 2] + [rng.randrange(65, 91) for _ in range(rng.randrange(1, 20))] for i in range(6)]
    config = GenConfig(max_new_tokens=12, temperature=0.0)
    reference = {tuple(p): cold(rig.ports[0], p, config) for p in prompts}
    rows = []
    try:
        for _ in range(trials):
            outcomes: list[bool] = []

            def worker(seed: int, outcomes=outcomes) -> None:
                local, client = random.Random(seed), rig.client()
                for _ in range(6):
                    p = local.choice(prompts)
                    tokens, _done = streamed(client, p, config, lambda e, t: None)
                    outcomes.append(tokens == reference[tuple(p)])
                client.close_channel()

            threads = [threading.Thread(target=worker, args=(rng.randrange(1 << 30),)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            rows.append({"exact": len(outcomes) == 24 and all(outcomes), "ended": "served"})
    finally:
        rig.stop()
    return rows


def _capped_files() -> None:
    """In the child: files over 4 KiB fail to write (EFBIG, as ENOSPC would) instead of killing it."""
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def disk_full(trials: int, rng: random.Random) -> list[dict]:
    folder = tempfile.mkdtemp(prefix="forkline-faults-")
    rig = Rig(1)
    rig.prefix.stop()
    flags = [
        "--engine",
        f"127.0.0.1:{rig.ports[0]}",
        "--port",
        str(rig.prefix_port),
        "--snapshot_dir",
        folder,
    ]
    rig.prefix = Process(["prefix_service", *flags], ["grpc"], preexec=_capped_files)
    rows = []
    try:
        client = rig.client()
        rig.routable(client, 1)
        for _ in range(trials):
            prompt = random_prompt(rng)
            config = GenConfig(max_new_tokens=16, temperature=0.0)
            first, _ = streamed(client, prompt, config, lambda e, t: None)
            time.sleep(0.3)  # the write-behind writer tries, and fails
            question = prompt + [ord("?")]
            tokens, done = streamed(client, question, config, lambda e, t: None)
            disk = client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).snapshot_dir
            exact = first == cold(rig.ports[0], prompt, config) and tokens == cold(
                rig.ports[0], question, config
            )
            ended = "write_failed_served" if disk.failed and done.reused_positions else "other"
            rows.append({"exact": exact, "ended": ended, "failed_writes": disk.failed})
        client.close_channel()
    finally:
        rig.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def prefix_kill(trials: int, rng: random.Random) -> list[dict]:
    folder = tempfile.mkdtemp(prefix="forkline-faults-")
    rig = Rig(1, folder)
    rows = []
    try:
        for _ in range(trials):
            client = rig.client()
            prompt = random_prompt(rng)
            config = GenConfig(max_new_tokens=NEW_TOKENS, temperature=0.0)
            point = rng.randrange(1, NEW_TOKENS - 5)

            def fault(event, tokens, point=point) -> None:
                if len(tokens) >= point and rig.prefix.proc.poll() is None:
                    rig.prefix.proc.kill()

            try:
                streamed(client, prompt, config, fault)
                ended = "completed"
            except ForklineError:
                ended = "error_then_retried"
            client.close_channel()
            rig.prefix.proc.wait(30)
            rig.prefix = rig._prefix()
            client = rig.client()
            tokens, _ = streamed(client, prompt, config, lambda e, t: None)
            rows.append({"exact": tokens == cold(rig.ports[0], prompt, config), "ended": ended})
            client.close_channel()
    finally:
        rig.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def summary(rows: list[dict]) -> dict:
    """The class's trials, exact outputs, endings, and the cached counts checked against the ids
    (``LEDGER``: streams whose reused positions exceeded what any earlier stream had computed)."""
    checked, reused, over = LEDGER.take()
    return {"trials": len(rows), "exact": sum(r["exact"] for r in rows),
            "ended": dict(Counter(r["ended"] for r in rows)), "cached_counts_checked": checked,
            "reused_positions_checked": reused,
            "cached_over_reused": over, "rows": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--classes", nargs="+", default=list(CLASSES), choices=CLASSES)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "out", "faults.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    report = {"new_tokens": NEW_TOKENS, "step_s": STEP_S, "classes": {}}
    for kind in args.classes:
        if kind in ("bitflip", "truncate"):
            rows = file_faults(kind, args.trials, rng)
        elif kind == "prefix_kill":
            rows = prefix_kill(args.trials, rng)
        elif kind in ("kill_export", "kill_import"):
            rows = handoff_faults(kind, args.trials, rng)
        elif kind == "kv_dtype_swap":
            rows = kv_dtype_swap(args.trials, rng)
        elif kind == "evict_race":
            rows = evict_race(args.trials, rng)
        elif kind == "disk_full":
            rows = disk_full(args.trials, rng)
        elif kind == "dns_gone":
            rows = dns_gone(args.trials, rng, NEW_TOKENS)
        else:
            rows = engine_faults(kind, args.trials, rng)
        report["classes"][kind] = summary(rows)
        print(
            json.dumps({kind: {k: v for k, v in report["classes"][kind].items() if k != "rows"}}), flush=True
        )
    report["all_exact"] = all(c["exact"] == c["trials"] for c in report["classes"].values())
    report["cached_never_over"] = all(not c["cached_over_reused"] for c in report["classes"].values())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({k: ({n: {x: y for x, y in c.items() if x != "rows"} for n, c in v.items()}
                          if k == "classes" else v) for k, v in report.items()}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
