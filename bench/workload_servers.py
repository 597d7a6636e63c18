"""The workload bench's servers, one at a time: forkline (``forkline-engine`` + ``forkline-prefix
--http_port``, default flags plus what the bench adds) and llama-server (``-np 4 -c 16384``), each with
what it holds at the end: forkline's Prometheus gauges, llama-server's ``/slots``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx

_ADDRESS = {
    "grpc": re.compile(r"(?<!HTTP )listening on (\S+:\d+)"),
    "http": re.compile(r"HTTP listening on (\S+:\d+)"),
    "metrics": re.compile(r"metrics on (http://\S+/metrics)"),
}


class Process:
    """``python -m argv`` with the addresses it prints (grpc, http, metrics) as they appear."""

    def __init__(
        self, argv: Sequence[str], wanted: Sequence[str], timeout: float = 240.0, preexec=None
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=preexec,
        )  # fmt: skip
        self.found: dict[str, str] = {}
        self.tail: list[str] = []
        done = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.tail = (self.tail + [line.rstrip()])[-80:]
                for key, pattern in _ADDRESS.items():
                    match = pattern.search(line)
                    if match and key not in self.found:
                        self.found[key] = match.group(1)
                if all(k in self.found for k in wanted):
                    done.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not done.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{argv[0]} did not start: {' | '.join(self.tail[-5:])}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:  # its drain outlived the allowance
                self.proc.kill()
                self.proc.wait(10)


class Forkline:
    """An engine and a prefix service with its HTTP door; ``base`` is the door's URL."""

    def __init__(
        self, model: str, engine_flags: Sequence[str] = (), prefix_flags: Sequence[str] = ()
    ) -> None:
        common = ["--port", "0", "--metrics_port", "0", "--log_level", "WARNING"]
        self.engine = Process(
            ["engine_service", "--model", model, *common, *engine_flags], ("grpc", "metrics")
        )
        try:
            self.prefix = Process(
                ["prefix_service", "--engine", self.engine.found["grpc"], "--http_port", "0",
                 "--http_model_name", model, *common, *prefix_flags],
                ("grpc", "http", "metrics"),
            )  # fmt: skip
        except RuntimeError:
            self.engine.stop()
            raise
        self.base = f"http://{self.prefix.found['http']}"

    def held(self, bytes_per_position: int) -> dict:
        """What the cache holds now: its gauges, every byte gauge either service exports, and the
        positions x ``bytes_per_position`` estimate where no byte gauge exists."""
        prefix = scrape(self.prefix.found["metrics"])
        engine = scrape(self.engine.found["metrics"])
        out = {k.removeprefix("forkline_prefix_"): v for k, v in prefix.items() if k in _PREFIX_GAUGES}
        byte_gauges = {
            k: v for k, v in (prefix | engine).items() if k.startswith("forkline_") and "bytes" in k
        }
        out["byte_gauges"] = byte_gauges
        held = next(
            (v for k, v in byte_gauges.items() if k.startswith("forkline_prefix") and not _LIMIT.search(k)),
            None,
        )
        out["bytes_held"] = held if held is not None else out.get("positions", 0) * bytes_per_position
        out["bytes_source"] = "gauge" if held is not None else "positions x bytes per position (estimate)"
        return out

    def close(self) -> None:
        self.prefix.stop()
        self.engine.stop()


_LIMIT = re.compile(r"max|budget|limit|snapshot")
_PREFIX_GAUGES = (
    "forkline_prefix_entries",
    "forkline_prefix_positions",
    "forkline_prefix_max_positions",
    "forkline_prefix_evictions_total",
    "forkline_prefix_inserts_total",
    "forkline_prefix_hits_total",
)


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page ({} when it cannot be read)."""
    try:
        text = httpx.get(url, timeout=30).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*) ([-+\d.eE]+|NaN)", line.strip())
        if match:
            out[match.group(1)] = float(match.group(2))
    return out


def llama_held(base: str, bytes_per_position: int, ctx: int) -> dict:
    """llama-server's slots: positions they hold now (where its build's ``/slots`` says) and the K/V
    its ``-c`` allocates up front."""
    try:
        slots = httpx.get(base + "/slots", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        slots = []
    counts = [s.get("n_past", s.get("n_tokens")) for s in slots if isinstance(s, dict)]
    out: dict = {"kv_allocated_bytes": ctx * bytes_per_position}
    if counts and all(isinstance(n, int) for n in counts):
        out["bytes_held"] = sum(counts) * bytes_per_position
        out["bytes_source"] = "slot positions x bytes per position (its --cache-ram prompt cache not counted)"
    else:  # this build's /slots does not say what each slot holds
        out["bytes_held"] = None
        out["bytes_source"] = "not reported by this build's /slots"
    return out


def bytes_per_position(config, itemsize: int = 2) -> int:
    """K and V of every layer at one position, ``itemsize`` bytes an element (float16)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
