"""llama.cpp's ``llama-server`` as a peer process for the benchmarks and fixture recorders.

``with LlamaServer(binary, model_path, threads=2) as server: server.post("/completion", {...})``
starts it on a free loopback port, waits for ``/health`` and stops it on exit. llama.cpp is a peer to
measure against, never a dependency: /work/shared/PEERS.md has the build recipe.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode("utf-8"))


def server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    text = (out.stdout + out.stderr).strip()
    match = re.search(r"version: .*", text)
    return match.group(0) if match else text.splitlines()[-1] if text else "unknown"


class LlamaServer:
    """A running ``llama-server -m model -t threads -c ctx -np slots`` (plus ``extra`` arguments)."""

    def __init__(
        self,
        binary: str,
        model: str,
        *,
        threads: int = 2,
        ctx: int = 2048,
        slots: int = 1,
        extra: Sequence[str] = (),
        startup_s: float = 180.0,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [
            binary,
            "-m",
            model,
            "-t",
            str(threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-c",
            str(ctx),
            "-np",
            str(slots),
            *extra,
        ]
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self._proc.returncode}; see {self._log.name}")
            try:
                if self.get("/health", timeout=5).get("status") == "ok":
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server not ready after {startup_s:.0f} s; see {self._log.name}")
            time.sleep(0.5)

    def get(self, path: str, timeout: float = 120.0) -> dict:
        return request(self.base + path, None, timeout)

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        return request(self.base + path, body, timeout)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        os.unlink(self._log.name)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
