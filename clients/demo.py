"""The services demo: ``python -m clients.demo [PROMPT] [--rounds 2] [--max_new_tokens 64] [--engines 1]``.
Runs the prompt through a prefix service over fresh engines ``--rounds`` times, printing each round's reuse;
exit 0 when every later round reused all but the last prompt token. ``--restart_engine``: one more round
after the serving engine is killed and restarted (the prompt comes back from the snapshot folder)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.stream_events import FinishReason
from protos import prefix_pb2

_LISTENING = re.compile(r"listening on (\S+:\d+)")
CHAT_PROMPT = "What is the capital of France? Answer in one sentence."
PLAIN_PROMPT = "The capital of France is"


class Service:
    """A service subprocess; ``address`` is read from its ``listening on HOST:PORT`` line."""

    def __init__(self, name: str, argv: list[str], timeout: float = 180.0) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        found = threading.Event()
        self.address = ""

        def read() -> None:
            for line in self.proc.stdout:
                match = _LISTENING.search(line)
                if match and not found.is_set():
                    self.address = match.group(1)
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not found.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start (exit status {self.proc.returncode})")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def restart(engine: Service, engine_argv: list[str]) -> Service:
    """kill -9 ``engine`` and start it again on the same port (a new engine instance: every session of the
    old one is gone)."""
    port = engine.address.rsplit(":", 1)[1]
    engine.proc.kill()
    engine.proc.wait()
    print(f"forkline-engine {engine.address} killed (SIGKILL); restarting it on port {port} ...", flush=True)
    argv = list(engine_argv)
    argv[argv.index("--port") + 1] = port
    return Service("forkline-engine", argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "prompt",
        nargs="?",
        default=None,
        help=f"default: {CHAT_PROMPT!r} as a chat, or {PLAIN_PROMPT!r} as plain text (--no_chat, or "
        "a base model without a chat template such as gemma-3-270m)",
    )
    p.add_argument(
        "--model", default=None, help="a packaged model name (smollm2-135m, gemma-3-270m) or a path"
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--no_chat", action="store_true", help="send the prompt as plain text (no chat template)")
    p.add_argument("--engines", type=int, default=1, help="engine processes behind the prefix service")
    p.add_argument(
        "--restart_engine",
        action="store_true",
        help="then kill -9 the engine, restart it and run one more round: served from the prefix "
        "service's snapshot directory",
    )
    args = p.parse_args(argv)
    if args.engines < 1:
        p.error(f"--engines must be >= 1, got {args.engines}")

    ok = True
    with ExitStack() as stack:
        many = f" x {args.engines}" if args.engines > 1 else ""
        print(f"starting forkline-engine{many} ...", flush=True)
        engine_argv = ["engine_service", "--port", "0", "--max_sessions", "8", "--log_level", "WARNING"]
        if args.model:
            engine_argv += ["--model", args.model]
        engines: list[Service] = []
        for i in range(args.engines):
            engines.append(Service("forkline-engine", engine_argv))
            # stops whichever process serves engine i by then (a restarted one included)
            stack.callback(
                lambda i=i: print(
                    f"forkline-engine {engines[i].address} stopped (exit {engines[i].stop()})", flush=True
                )
            )
        prefix_argv = [
            "prefix_service",
            *(a for e in engines for a in ("--engine", e.address)),
            "--port",
            "0",
            "--log_level",
            "WARNING",
        ]
        if args.restart_engine:
            prefix_argv += [
                "--snapshot_dir",
                stack.enter_context(tempfile.TemporaryDirectory(prefix="forkline-snap-")),
            ]
        prefix = Service("forkline-prefix", prefix_argv)
        stack.callback(lambda: print(f"forkline-prefix stopped (exit {prefix.stop()})", flush=True))
        chat = not args.no_chat
        for engine in engines:
            info = EngineClient(engine.address).info()
            print(
                f"engine {engine.address} ({os.path.basename(info.model)}, {info.architecture}, {info.cache_kind}, "
                f"instance {info.instance_id})",
                flush=True,
            )
            if chat and not info.chat_template:
                print("  the model has no chat template (a base model): prompts go as plain text", flush=True)
                chat = False
        prompt_text = args.prompt if args.prompt is not None else (CHAT_PROMPT if chat else PLAIN_PROMPT)
        print(f"prefix service {prefix.address}", flush=True)
        served = []
        client = PrefixClient(prefix.address, owner="demo")
        texts = []
        rounds = args.rounds + (1 if args.restart_engine else 0)
        for round_ in range(1, rounds + 1):
            if args.restart_engine and round_ == rounds:  # the engine that holds the prompt
                i = next((i for i, e in enumerate(engines) if e.address == served[-1]), 0)
                engines[i] = restart(engines[i], engine_argv)
            t0 = time.perf_counter()
            out = client.generate(
                text=prompt_text,
                chat=chat,
                config=GenConfig(max_new_tokens=args.max_new_tokens),
                namespace="demo",
            ).collect()
            elapsed = time.perf_counter() - t0
            d = out.done
            prompt = d.prompt_positions + d.reused_positions
            served.append(d.engine)
            print(
                f"round {round_}: reused {d.reused_positions}/{prompt} prompt tokens on engine {d.engine}, ttft "
                f"{d.time_to_first_token_s * 1000:.0f} ms, {d.generated_tokens} tokens at "
                f"{d.decode_tokens_per_s:.1f} tok/s, {elapsed:.2f} s, finish {d.finish_reason}",
                flush=True,
            )
            print(f"  {out.text.strip()}", flush=True)
            texts.append(out.text)
            ok &= d.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            if round_ > 1:
                ok &= d.reused_positions == prompt - 1
        stats = client.stats()
        print(
            f"prefix cache: {stats.entries} entries, {stats.hits} hits, {stats.misses} misses, "
            f"{stats.reused_positions} positions reused",
            flush=True,
        )
        if args.restart_engine:
            disk = client.stub.Stats(prefix_pb2.StatsRequest()).snapshot_dir
            print(
                f"snapshot directory: {disk.files} files, {disk.bytes / 2**20:.1f} MiB, {disk.written} written, "
                f"{disk.restored} restored after the restart",
                flush=True,
            )
            ok &= disk.restored >= 1
        client.close_channel()
        ok &= len(set(texts)) == 1  # greedy: every round says the same
        ok &= (
            len(set(served[: args.rounds])) == 1
        )  # every round went to the engine holding the prompt (after a
        # restart another engine may serve: any engine of the same fingerprint loads the file)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
