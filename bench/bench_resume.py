"""Streams that outlive their engine (docs/RESUME.md): two engine processes of one model behind a
prefix service; each trial streams a 200-token answer and ``kill -9``s the engine serving it at a
random token, then restarts it on the same port. Greedy and seeded, through the gRPC gateway and the
HTTP door (``/v1/completions``, streamed). Per trial: whether the stream equals the uninterrupted run,
the client's pause (gRPC: ``Done.resume_pause_s``; HTTP: the longest gap between chunks), the positions
the resume recomputed. Prints JSON, draws a PNG next to --out.

    .venv/bin/python bench/bench_resume.py [--models smollm2 gemma3] [--trials 20]
        [--out bench/out/resume.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_workloads import ALIASES  # noqa: E402
from workload_client import http_client  # noqa: E402
from workload_servers import Process  # noqa: E402

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)
from clients.prefix_client import PrefixClient  # noqa: E402
from engine_service.api.config import GenConfig  # noqa: E402
from engine_service.api.stream_events import Done, Tokens  # noqa: E402
from protos import prefix_pb2  # noqa: E402

NEW_TOKENS = 200
PROMPT = (
    "A field guide to the rivers of the northern valleys, their bridges, mills and the towns that grew "
    "beside them, written for walkers who like to know what they are looking at. "
) * 3
MODES = {"greedy": (0.0, 0), "seeded": (0.8, 1234)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """Two engine processes on fixed ports and a prefix service (gRPC and HTTP) over them."""

    def __init__(self, model: str, prefix_flags: tuple[str, ...] = ()) -> None:
        self.model, self.ports = model, [free_port(), free_port()]
        self.engines = {p: self._engine(p) for p in self.ports}
        addresses = [a for p in self.ports for a in ("--engine", f"127.0.0.1:{p}")]
        self.prefix = Process(
            ["prefix_service", *addresses, "--port", "0", "--http_port", "0", *prefix_flags], ["grpc", "http"]
        )
        self.client = PrefixClient(self.prefix.found["grpc"], owner="bench", timeout=600)
        self.http = f"http://{self.prefix.found['http']}/v1"
        self.served = httpx.get(self.http + "/models", timeout=60).json()["data"][0]["id"]

    def _engine(self, port: int) -> Process:
        return Process(["engine_service", "--model", self.model, "--port", str(port)], ["grpc"])

    def stats(self) -> dict[str, prefix_pb2.EngineStats]:
        return {e.engine: e for e in self.client.stub.Stats(prefix_pb2.StatsRequest(), timeout=30).engines}

    def kill_serving(self) -> None:
        serving = [a for a, s in self.stats().items() if s.in_flight > 0]
        port = int(serving[0].rsplit(":", 1)[1])
        self.engines[port].proc.kill()
        self.engines[port].proc.wait(30)
        self.killed = port

    def restart(self) -> None:
        """The killed engine back on its port, routable again."""
        for attempt in range(5):  # the port may be briefly held (another process took it meanwhile)
            try:
                self.engines[self.killed] = self._engine(self.killed)
                break
            except RuntimeError:
                if attempt == 4:
                    raise
                time.sleep(2)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if sum(s.routable for s in self.stats().values()) == 2:
                return
            time.sleep(0.2)
        raise RuntimeError("the restarted engine did not become routable")

    def stop(self) -> None:
        self.client.close_channel()
        for process in [self.prefix, *self.engines.values()]:
            process.stop()


def grpc_run(fleet: Fleet, mode: str, kill_at: int | None, salt: str = "") -> dict:
    temperature, seed = MODES[mode]
    config = GenConfig(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=seed)
    tokens: list[int] = []
    arrivals: list[float] = []  # seconds from the request to each token
    done: Done | None = None
    killed = False
    sent = time.perf_counter()
    stream = fleet.client.generate(
        text=PROMPT, config=config, ignore_eos=True, namespace=mode, cache_salt=salt
    )
    for event in stream:
        if isinstance(event, Tokens):
            tokens.extend(event.ids)
            arrivals += [time.perf_counter() - sent] * len(event.ids)
            if kill_at is not None and not killed and len(tokens) >= kill_at:
                fleet.kill_serving()
                killed = True
        elif isinstance(event, Done):
            done = event
    assert done is not None
    return {
        "out": tokens,
        "arrivals": arrivals,
        "pause_s": done.resume_pause_s,
        "resumes": done.resumes,
        "recomputed": done.resumed_positions,
    }


def http_run(fleet: Fleet, mode: str, kill_at: int | None, salt: str = "") -> dict:
    temperature, seed = MODES[mode]
    body = {"model": fleet.served, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": temperature,
            "seed": seed, "stream": True, **({"cache_salt": salt} if salt else {})}  # fmt: skip
    pieces: list[str] = []
    gaps: list[float] = []
    arrivals: list[float] = []
    killed, last, sent = False, 0.0, time.perf_counter()
    with http_client().stream("POST", fleet.http + "/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            now = time.perf_counter()
            if killed and last:
                gaps.append(now - last)
            last = now
            pieces.append("".join(c.get("text") or "" for c in chunk["choices"]))
            arrivals.append(now - sent)
            if kill_at is not None and not killed and len(pieces) >= kill_at:
                fleet.kill_serving()
                killed, last = True, time.perf_counter()
    return {
        "out": "".join(pieces),
        "arrivals": arrivals,
        "pause_s": max(gaps, default=0.0),
        "chunks": len(pieces),
    }


def run_model(name: str, trials: int, rng: random.Random, prefix_flags: tuple[str, ...] = ()) -> dict:
    fleet = Fleet(name, prefix_flags)
    rows = []
    try:
        doors = {"grpc": grpc_run, "http": http_run}
        reference = {(door, mode): run(fleet, mode, None) for door, run in doors.items() for mode in MODES}
        for trial in range(trials):
            door, mode = ("grpc", "http")[trial % 2], ("greedy", "seeded")[(trial // 2) % 2]
            ref = reference[(door, mode)]
            length = len(ref["out"]) if door == "grpc" else ref["chunks"]
            kill_at = rng.randint(1, max(1, length - 2))
            try:
                # its own cache scope: what the reference run or an earlier trial stored is not reused
                got = doors[door](fleet, mode, kill_at, f"trial-{trial}")
            except Exception:
                print("\n".join(fleet.prefix.tail), file=sys.stderr)
                raise
            fleet.restart()
            # a client that restarts instead waits this long for the same tokens again (the reference)
            scratch = ref["arrivals"][kill_at - 1]
            row = {"door": door, "mode": mode, "kill_at": kill_at, "exact": got["out"] == ref["out"],
                   "pause_s": round(got["pause_s"], 4), "scratch_s": round(scratch, 4)}  # fmt: skip
            if door == "grpc":
                row |= {"resumes": got["resumes"], "recomputed": got["recomputed"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        fleet.stop()
    pauses = sorted(r["pause_s"] for r in rows)
    greedy = reference[("grpc", "greedy")]["arrivals"]
    return {
        "decode_tok_s": round((len(greedy) - 1) / (greedy[-1] - greedy[0]), 1),
        "pause_over_restart_max": round(max(r["pause_s"] / r["scratch_s"] for r in rows), 3),
        "trials": rows,
        "exact": sum(r["exact"] for r in rows),
        "of": len(rows),
        "pause_p50_s": round(statistics.median(pauses), 4),
        "pause_p99_s": round(pauses[min(len(pauses) - 1, int(0.99 * len(pauses)))], 4),
        "resumed_every_grpc_stream": all(r.get("resumes", 1) == 1 for r in rows),
        "recomputed_max": max((r["recomputed"] for r in rows if "recomputed" in r), default=0),
    }


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in report["models"].items():
        for door in ("grpc", "http"):
            rows = [t for t in r["trials"] if t["door"] == door]
            ax.scatter(
                [t["kill_at"] for t in rows], [t["pause_s"] * 1000 for t in rows], label=f"{name} {door}"
            )
    ax.set_xlabel("token at which the serving engine was killed")
    ax.set_ylabel("client pause (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--checkpoint_tokens",
        type=int,
        default=0,
        help="decode checkpoints: the prefix service's --resume_checkpoint_tokens N with a snapshot directory",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "out", "resume.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    report = {"new_tokens": NEW_TOKENS, "checkpoint_tokens": args.checkpoint_tokens,
              "load_average_1_5_15min": list(os.getloadavg()), "models": {}}  # fmt: skip
    folder = tempfile.mkdtemp(prefix="forkline-resume-") if args.checkpoint_tokens else ""
    flags = (
        ("--snapshot_dir", folder, "--resume_checkpoint_tokens", str(args.checkpoint_tokens))
        if folder
        else ()
    )
    for model in args.models:
        name = ALIASES.get(model, model)
        report["models"][name] = run_model(name, args.trials, rng, flags)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(report, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({k: v for k, v in report.items() if k != "models"} | {
        m: {k: v for k, v in r.items() if k != "trials"} for m, r in report["models"].items()}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
