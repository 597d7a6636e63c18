"""``forkline-engine`` / ``python -m engine_service``: serve the engine over gRPC.

Prints ``forkline-engine listening on HOST:PORT`` once it serves (``--port 0`` picks a free port).
SIGTERM / SIGINT drain gracefully: new calls get UNAVAILABLE, streams in flight get ``--grace``
seconds, then every session is closed and the engine thread stops.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine_service.errors import ForklineError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine_service.rpc.service_main import port_number

    p = argparse.ArgumentParser(prog="forkline-engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or MLX model folder (default: packaged SmolLM2-135M)")
    p.add_argument("--weights_dtype", default="auto", help="auto | float32 | float16 | bfloat16 | quantized")
    p.add_argument("--cache_kind", default="batched-sequence", help="batched-sequence | batched-cell")
    p.add_argument("--max_sessions", type=int, default=32, help="resident sessions: requests + snapshots")
    p.add_argument("--max_session_tokens", type=int, default=2048)
    p.add_argument("--max_decode_sequences", type=int, default=8)
    p.add_argument("--prefill_chunk", type=int, default=512)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=50051, help="0 picks a free port")
    p.add_argument("--idle_session_timeout", type=float, default=300.0,
                   help="seconds after which an idle client session handle expires (0: never)")
    p.add_argument("--persistent_owner", action="append", default=None,
                   help="owner whose handles never expire (repeatable; default: prefix-service)")
    p.add_argument("--prepared_inputs", action="store_true",
                   help="accept prepared 'embeddings' inputs (EmbeddingsExecutor)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds streams get to finish at shutdown")
    p.add_argument("--log_level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from engine_service.rpc.service_main import serve_until_signalled

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from engine_service.model.loader import load_model
    from engine_service.rpc.server import create_server
    from engine_service.rpc.servicer import EngineDeps

    try:
        loaded = load_model(args.model, args.weights_dtype)
        deps = EngineDeps.build(
            loaded,
            loaded.tokenizer,
            model_name=loaded.path,
            chat=loaded.chat,
            cache_kind=args.cache_kind,
            max_sessions=args.max_sessions,
            max_session_tokens=args.max_session_tokens,
            max_decode_sequences=args.max_decode_sequences,
            prefill_chunk=args.prefill_chunk,
            idle_timeout_s=args.idle_session_timeout,
            persistent_owners=tuple(args.persistent_owner or ("prefix-service",)),
            prepared_inputs=args.prepared_inputs,
        )
        server, port = create_server(deps, f"{args.host}:{args.port}")
    except (ForklineError, OSError) as exc:
        print(f"forkline-engine: {exc}", file=sys.stderr)
        return 2
    serve_until_signalled("forkline-engine", args.host, port)
    logging.getLogger("forkline-engine").info("draining (grace %.1f s)", args.grace)
    server.stop(args.grace, shutdown_runner=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
