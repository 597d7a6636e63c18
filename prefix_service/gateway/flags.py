"""The gateway flags of forkline-prefix: tenancy (shared namespaces, the admin owner; ``tenancy.py``),
whether a generation's answer is cached too, and joining prefixes in flight (``inflight.py``)."""

from __future__ import annotations

import argparse

from prefix_service.gateway.inflight import DEFAULT_MAX_WAIT_S, JoinConfig
from prefix_service.gateway.tenancy import Tenancy


def add_tenancy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shared_namespace",
        metavar="NAME",
        action="append",
        default=None,
        help="with --auth_tokens, the namespace NAME is every caller's (e.g. a common system prompt); "
        "any other belongs to its caller's owner. Repeatable (default: none)",
    )
    p.add_argument(
        "--admin_owner",
        metavar="OWNER",
        default="",
        help="the owner whose Stats and Clear cover every namespace; any other owner's cover its own "
        "(default: none; without --auth_tokens every caller's cover everything)",
    )


def tenancy(args: argparse.Namespace) -> Tenancy:
    """The shared namespaces (--shared_namespace, and --http_namespace when given) and the admin owner."""
    http = getattr(args, "http_namespace", None)
    shared = [*(args.shared_namespace or ()), *([http] if http is not None else [])]
    return Tenancy.of(shared, args.admin_owner)


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache_generated",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="store each generation's session at its last committed token (the prompt and the "
        "answer but its last token), keyed by those ids in the same namespace and budget, so a "
        "follow-up turn reuses the answer's positions too; --no-cache_generated: only prompts "
        "(default: on)",
    )
    p.add_argument(
        "--resume_checkpoint_tokens",
        metavar="N",
        type=int,
        default=0,
        help="decode checkpoints: every N generated tokens store the generating session (prompt + "
        "answer so far) like a final snapshot, written to --snapshot_dir when set, so a stream resumed "
        "on another engine (docs/RESUME.md) recomputes at most about N tokens; 0: off (default: "
        "%(default)s)",
    )


def add_join_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--join_wait_ms",
        metavar="MS",
        type=float,
        default=DEFAULT_MAX_WAIT_S * 1000,
        help="a request whose prompt shares a prefix with one its engine is prefilling now (same scope) "
        "waits for that prompt's snapshot, when that is expected to be cheaper than computing the shared "
        "positions, at most MS milliseconds; 0: never wait (default: %(default)s)",
    )


def check_join_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.join_wait_ms >= 0:  # NaN too
        parser.error(f"--join_wait_ms must be >= 0, got {args.join_wait_ms}")
    if args.resume_checkpoint_tokens < 0:
        parser.error(f"--resume_checkpoint_tokens must be >= 0, got {args.resume_checkpoint_tokens}")


def joins_from(args: argparse.Namespace) -> JoinConfig:
    return JoinConfig(max_wait_s=args.join_wait_ms / 1000)
