"""The HTTP door flags of forkline-prefix (``--http_*``)."""

from __future__ import annotations

import argparse

from engine_service.serving.service_main import port_number


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http_namespace",
        metavar="NAME",
        default=None,
        help="HTTP requests use this namespace, shared by every caller (as --shared_namespace); "
        "default: each caller's own (one namespace for all without --auth_tokens)",
    )
    p.add_argument(
        "--http_port",
        metavar="PORT",
        type=port_number,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...) on this port of "
        "--host, in this process, with the same tokens and TLS; 0 picks a free one "
        "(default: off)",
    )
    p.add_argument(
        "--http_model_name",
        metavar="NAME",
        default="",
        help="the model id HTTP clients send (default: the engine's model file name)",
    )
