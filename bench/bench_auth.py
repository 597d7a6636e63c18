"""What authentication costs at the gateway: TTFT of prefix-gateway hits with auth off, with bearer
tokens on both services, and with tokens + TLS on both hops (client -> prefix -> engine).

Each setting has its own engine and prefix service (in this process, 127.0.0.1) over the same weights
and prompt: one cold request stores it, then ``--requests`` gateway hits per setting, interleaved
across the settings (so load drift hits all alike), are timed by the client from request to first
token (a hit replays one token, so the time is mostly RPC, lookup and clone: where auth overhead would
show; the prompt is text, so the engine Tokenize call carries the caller's forwarded token). Reports
the median TTFT per setting, the ratios to auth off (one run), and the interceptor's token check alone
(microseconds per call with 3 / 100 / 1000 tokens in the table).

Prints one JSON object, writes bench/out/bench_auth.json and bench/out/bench_auth.png.
Usage: .venv/bin/python bench/bench_auth.py [--model tiny|real] [--requests 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from engine_service.api.config import GenConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.service.pki

import engine_service  # noqa: E402,F401  (loads OpenBLAS before mlx)
from clients.engine_client import Tokens  # noqa: E402
from clients.prefix_client import PrefixClient  # noqa: E402
from engine_service.executors.options import ExecutorSettings
from engine_service.rpc.server import create_server  # noqa: E402
from engine_service.serving.auth import ClientSecurity, ServerSecurity, authenticate, server_credentials  # noqa: E402
from engine_service.serving.tokens import TokenTable  # noqa: E402
from engine_service.sessions.engine import EngineSessions  # noqa: E402
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine  # noqa: E402
from prefix_service.rpc.server import create_server as create_prefix_server  # noqa: E402
from tests.service.pki import write_test_pki  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
CLIENT, SERVICE = "bench-client-0123456789abcdef", "bench-prefix-0123456789abcdef"
PROMPT = "Write a short story about a robot who learns to paint. " * 4


def model(kind: str):
    if kind == "real":
        from engine_service.model.loading.loader import load_model

        loaded = load_model(None)
        return loaded, loaded.tokenizer, loaded.chat
    from engine_service.model.random_init import random_model
    from engine_service.model.text.chat import ChatFormatter
    from tests.service.conftest import char_tokenizer

    return random_model("FRFR", 4, 0), char_tokenizer(), ChatFormatter(name="chatml")


SETTINGS = ("off", "tokens", "tokens+tls")


class Setting:
    """An engine and a prefix service with auth ``name`` (one of SETTINGS) and a client of the gateway."""

    def __init__(self, name: str, weights, folder: str) -> None:
        os.makedirs(folder)
        tokens_path = os.path.join(folder, "tokens")
        with open(tokens_path, "w", encoding="utf-8") as f:
            f.write(f"{CLIENT} client\n{SERVICE} prefix-service\n")
        secured = name != "off"
        tls = write_test_pki(folder) if name == "tokens+tls" else None
        creds = server_credentials(tls.server_cert, tls.server_key) if tls else None
        security = ServerSecurity(TokenTable.load(tokens_path), creds) if secured else None
        deps = EngineSessions.build(
            weights[0],
            weights[1],
            model_name="bench",
            chat=weights[2],
            executor=ExecutorSettings(
                cache_kind="batched-sequence", max_sessions=8, max_session_tokens=1024, prefill_chunk=256
            ),
            sessions=UNLIMITED,
        )
        self.engine, port = create_server(deps, "127.0.0.1:0", security=security)
        engine_security = ClientSecurity(SERVICE if secured else None, tls.ca if tls else None)
        gateway, channel = connect_engine(f"127.0.0.1:{port}", max_entries=8, engine_security=engine_security)
        self.prefix, port = create_prefix_server(gateway, "127.0.0.1:0", channel=channel, security=security)
        self.client = PrefixClient(
            f"127.0.0.1:{port}",
            owner="client",
            token=CLIENT if secured else None,
            tls_ca=tls.ca if tls else None,
        )
        self.client.generate(
            text=PROMPT, config=GenConfig(max_new_tokens=1)
        ).collect()  # cold: stores the prompt

    def hit_ttft(self) -> float:
        t0 = time.perf_counter()
        ttft = 0.0
        for event in self.client.generate(text=PROMPT, config=GenConfig(max_new_tokens=1)):
            if isinstance(event, Tokens) and event.ids and not ttft:
                ttft = time.perf_counter() - t0
        return ttft

    def stop(self) -> None:
        self.client.close_channel()
        self.prefix.stop(0)
        self.engine.stop(0, shutdown_runner=True)


def authenticate_us(entries: int, calls: int = 2000) -> float:
    """Microseconds per interceptor token check (``rpc.auth.authenticate``) with ``entries`` tokens."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tokens")
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(f"token-{i:06d}-0123456789abcdef owner{i}\n" for i in range(entries)))
        table = TokenTable.load(path)
    metadata = (("authorization", f"Bearer token-{entries - 1:06d}-0123456789abcdef"),)
    t0 = time.perf_counter()
    for _ in range(calls):
        authenticate(table, metadata)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        choices=("tiny", "real"),
        default="tiny",
        help="the tiny random model or the packaged SmolLM2 (default: %(default)s)",
    )
    p.add_argument(
        "--requests", type=int, default=100, help="timed gateway hits per setting (default: %(default)s)"
    )
    args = p.parse_args()
    weights = model(args.model)
    samples: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as folder:
        settings = [Setting(name, weights, os.path.join(folder, str(i))) for i, name in enumerate(SETTINGS)]
        try:
            for i in range(args.requests + 3):  # interleaved: load drift hits every setting alike
                for name, setting in zip(SETTINGS, settings, strict=True):
                    ttft = setting.hit_ttft()
                    if i >= 3:  # the first three rounds warm up
                        samples[name].append(ttft)
        finally:
            for setting in settings:
                setting.stop()
    results = {name: statistics.median(values) for name, values in samples.items()}
    report = {
        "model": args.model,
        "requests": args.requests,
        "ttft_median_ms": {k: round(v * 1000, 3) for k, v in results.items()},
        "ratio_tokens_vs_off": round(results["tokens"] / results["off"], 3),
        "ratio_tokens_tls_vs_off": round(results["tokens+tls"] / results["off"], 3),
        "token_check_us": {str(n): round(authenticate_us(n), 2) for n in (3, 100, 1000)},
    }
    print(json.dumps(report))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_auth.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(list(results), [v * 1000 for v in results.values()], color=["#888", "#4a7", "#47a"])
    ax.set_ylabel("gateway hit TTFT, median (ms)")
    ax.set_title(f"auth cost at the gateway ({args.model} model)")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "bench_auth.png"), dpi=110)


if __name__ == "__main__":
    main()
