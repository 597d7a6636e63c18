"""mlx_run_llm_batched: prompts run concurrently in rounds, reusing prompt snapshots across rounds,
in-process or through the services (``--engine``). Usage: DESIGN.md section 6 and ``--help``."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from clients.cli_options import UsageError, build_parser, validate
from engine_service.api.errors import ForklineError, InvalidArgument

__all__ = ["build_parser", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        validate(args)
        if args.engine or args.prefix:
            if not args.engine:
                raise UsageError("--prefix needs --engine")
            from clients.remote_rounds import run_remote

            return run_remote(args, sys.stdout)
        from clients.local_rounds import run_local

        return run_local(args, sys.stdout)
    except (UsageError, InvalidArgument) as exc:  # ModelLoadError is an InvalidArgument
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ForklineError as exc:  # the engine cannot be built with these limits (ResourceExhausted, ...)
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output file cannot be written (e.g. its path is a directory)
        print(f"error: --out_prefix: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
