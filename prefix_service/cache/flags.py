"""The cache flags of forkline-prefix: its bounds (entries, positions, MiB), its share of the engine,
its retention policy and the checkpoints a captured prompt keeps on a sliding-window engine."""

from __future__ import annotations

import argparse

from prefix_service.cache.budget import DEFAULT_MAX_ENTRIES
from prefix_service.cache.checkpoints import (
    DEFAULT_CHECKPOINT_STRIDE,
    DEFAULT_MAX_CHECKPOINTS,
    CheckpointPlan,
)
from prefix_service.cache.retention import policy_names


def share(text: str) -> float:
    """argparse type: a share of the engine, in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max_entries",
        metavar="N",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="stored snapshots at most; each is a resident engine session, so --engine_share of the "
        "engine's --max_sessions caps them too, and bytes bound them first by default; 0 disables "
        "storing (default: %(default)s)",
    )
    p.add_argument(
        "--max_positions",
        metavar="N",
        type=int,
        default=0,
        help="positions the stored snapshots may hold together (also capped by --engine_share); "
        "0: only the share and --max_cache_mib bound them (default: %(default)s)",
    )
    p.add_argument(
        "--max_cache_mib",
        metavar="MIB",
        type=int,
        default=0,
        help="K/V memory the stored snapshots may hold together, in MiB at the engine's bytes per "
        "position (its Info); 0: only --engine_share of the engine's K/V memory bounds them "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--engine_share",
        metavar="F",
        type=share,
        default=0.5,
        help="share of the engine's resident sessions and of the positions its K/V memory holds "
        "(--kv_memory_mib) this service may hold for its snapshots, in (0, 1] (default: %(default)s)",
    )
    p.add_argument(
        "--policy",
        default="lru",
        choices=policy_names(),
        help="which entry is evicted when the cache is full (default: %(default)s)",
    )
    p.add_argument(
        "--checkpoint_stride",
        metavar="N",
        type=int,
        default=DEFAULT_CHECKPOINT_STRIDE,
        help="on an engine whose cache evicts sliding-window rows (batched-sequence with sliding "
        "layers), a captured prompt keeps checkpoints where a later prompt is likely to diverge (each "
        "chat message's end, and branch points: where stored prompts already diverged from it), so a "
        "prompt diverging there reuses an exact prefix; N > 0 also keeps one every N positions "
        "(default: %(default)s, off)",
    )
    p.add_argument(
        "--max_checkpoints",
        metavar="N",
        type=int,
        default=DEFAULT_MAX_CHECKPOINTS,
        help="checkpoints per captured prompt at most (message ends and branch points first, then "
        "stride points spread evenly); each is a cache entry weighing its positions; 0: no "
        "checkpoints (default: %(default)s)",
    )


def check_cache_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("max_entries", "max_positions", "max_cache_mib", "checkpoint_stride", "max_checkpoints"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")


def checkpoints_from(args: argparse.Namespace) -> CheckpointPlan:
    return CheckpointPlan(args.checkpoint_stride, args.max_checkpoints)
