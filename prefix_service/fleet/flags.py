"""The routing flags of forkline-prefix (``--routing`` and its thresholds; docs/ROUTING.md)."""

from __future__ import annotations

import argparse

from prefix_service.fleet.cost_model import (
    DEFAULT_MIN_REUSE_FRACTION,
    DEFAULT_MIN_REUSE_POSITIONS,
    CostConfig,
)
from prefix_service.fleet.resume import MAX_RESUMES
from prefix_service.fleet.routing import (
    DEFAULT_IMBALANCE_ABS,
    DEFAULT_IMBALANCE_REL,
    DEFAULT_ROUTING,
    RoutingPolicy,
    routing_names,
    routing_policy,
)


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--routing",
        default=DEFAULT_ROUTING,
        choices=routing_names(),
        help="which engine serves a request: cost (the lowest expected time to first token: positions "
        "to compute x measured prefill rate + queue, see docs/ROUTING.md), cache_aware (the most "
        "reused positions unless overloaded), least_loaded, round_robin (default: %(default)s)",
    )
    p.add_argument(
        "--route_min_reuse_fraction",
        metavar="F",
        type=float,
        default=DEFAULT_MIN_REUSE_FRACTION,
        help="cost: a reuse shorter than this share of the prompt does not decide, in [0, 1] "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--route_min_reuse_positions",
        metavar="N",
        type=int,
        default=DEFAULT_MIN_REUSE_POSITIONS,
        help="cost: nor one shorter than N positions, e.g. a chat template's header (default: %(default)s)",
    )
    p.add_argument(
        "--route_moves",
        choices=("on", "off"),
        default="on",
        help="cost: copy a loaded or draining engine's snapshot to the engine chosen when that is cheaper "
        "than recomputing it there (measured; docs/ROUTING.md Moves) (default: %(default)s)",
    )
    p.add_argument(
        "--route_imbalance_abs",
        metavar="N",
        type=int,
        default=DEFAULT_IMBALANCE_ABS,
        help="cache_aware: the best-matching engine is overloaded when its load exceeds the least "
        "loaded engine's by more than N requests and --route_imbalance_rel times "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--route_imbalance_rel",
        metavar="F",
        type=float,
        default=DEFAULT_IMBALANCE_REL,
        help="cache_aware: the factor of that guard, >= 1 (default: %(default)s)",
    )
    p.add_argument(
        "--max_resumes",
        metavar="N",
        type=int,
        default=MAX_RESUMES,
        help="an engine that fails mid-stream passes the generation to another engine, which continues "
        "the same stream exactly from the tokens already sent (docs/RESUME.md), at most N times per "
        "generation; 0: the stream ends with the error (default: %(default)s)",
    )


def check_routing_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_resumes < 0:
        parser.error(f"--max_resumes must be >= 0, got {args.max_resumes}")
    if args.route_imbalance_abs < 0:
        parser.error(f"--route_imbalance_abs must be >= 0, got {args.route_imbalance_abs}")
    if not args.route_imbalance_rel >= 1:
        parser.error(f"--route_imbalance_rel must be >= 1, got {args.route_imbalance_rel}")


def routing_from(args: argparse.Namespace) -> RoutingPolicy:
    cost = CostConfig(
        args.route_min_reuse_fraction, args.route_min_reuse_positions, moves=args.route_moves == "on"
    )
    return routing_policy(
        args.routing,
        imbalance_abs=args.route_imbalance_abs,
        imbalance_rel=args.route_imbalance_rel,
        cost=cost,
    )
