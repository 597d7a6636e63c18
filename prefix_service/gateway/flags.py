"""The gateway flags of forkline-prefix: tenancy (shared namespaces, the admin owner; ``tenancy.py``)
and whether a generation's answer is cached too."""

from __future__ import annotations

import argparse

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
