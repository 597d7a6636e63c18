"""What both service entry points share: the ``--port`` type and serving until SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import signal
import threading


def port_number(text: str) -> int:
    """argparse type for ``--port``: 0 (pick a free port) .. 65535. grpc would bind a larger number
    modulo 65536, i.e. on a port nobody asked for."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def serve_until_signalled(name: str, host: str, port: int) -> None:
    """Print ``<name> listening on HOST:PORT`` (clients and the demo read this line), then block until
    SIGTERM or SIGINT arrives. The caller drains its server afterwards."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"{name} listening on {host}:{port}", flush=True)
    stop.wait()
