"""``forkline-prefix`` / ``python -m prefix_service --engine ADDR``: serve the prefix cache over gRPC.

A separate process from the engine: it owns the PrefixCache and its retention policy and holds its
snapshots in the engine under a stable owner id (``--owner``). At start it releases what an earlier
instance of itself left in the engine. Prints ``forkline-prefix listening on HOST:PORT`` once it
serves. SIGTERM / SIGINT drain, release every stored snapshot in the engine, and exit.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine_service.errors import ForklineError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine_service.rpc.service_main import port_number

    p = argparse.ArgumentParser(prog="forkline-prefix", description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True, help="engine address HOST:PORT")
    p.add_argument("--max_entries", type=int, default=64, help="stored snapshots at most (0 disables)")
    p.add_argument("--policy", default="lru", help="retention policy: lru | priority | lfu")
    p.add_argument("--owner", default="prefix-service", help="owner id of the snapshots in the engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=50052, help="0 picks a free port")
    p.add_argument("--engine_timeout", type=float, default=30.0, help="seconds to wait for the engine at start")
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--log_level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from engine_service.rpc.service_main import serve_until_signalled

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from prefix_service.rpc.server import connect_engine, create_server

    try:
        deps, channel = connect_engine(args.engine, max_entries=args.max_entries, policy=args.policy,
                                       owner=args.owner, ready_timeout=args.engine_timeout)
        server, port = create_server(deps, f"{args.host}:{args.port}", channel=channel)
    except (ForklineError, OSError) as exc:
        print(f"forkline-prefix: {exc}", file=sys.stderr)
        return 2
    serve_until_signalled("forkline-prefix", args.host, port)
    server.stop(args.grace, release=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
