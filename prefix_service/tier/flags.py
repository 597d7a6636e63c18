"""The snapshot directory flags of forkline-prefix (``--snapshot_*``)."""

from __future__ import annotations

import argparse

from prefix_service.tier.persistent_tier import PersistentTier


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--snapshot_dir",
        metavar="DIR",
        default=None,
        help="persist stored prompt snapshots as files in DIR (written behind the request path; "
        "restored into an engine on a lookup after an engine or service restart) "
        "(default: none, memory only)",
    )
    p.add_argument(
        "--snapshot_max_mb",
        metavar="MB",
        type=int,
        default=4096,
        help="the files in --snapshot_dir hold at most this many MiB; over it, files are deleted "
        "in --policy order (default: %(default)s)",
    )
    p.add_argument(
        "--snapshot_queue",
        metavar="N",
        type=int,
        default=32,
        help="snapshots waiting to be written at most; more are dropped and counted (default: %(default)s)",
    )
    p.add_argument(
        "--snapshot_preload",
        metavar="N",
        type=int,
        default=0,
        help="restore the N most recently used files into each engine when it (re)joins; 0 restores "
        "only on demand, at the first lookup of a prompt (default: %(default)s)",
    )


def check_tier_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for flag in ("snapshot_max_mb", "snapshot_queue", "snapshot_preload"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")


def tier_from(args: argparse.Namespace) -> PersistentTier | None:
    """The snapshot directory (None without --snapshot_dir); files are evicted in --policy order."""
    if not args.snapshot_dir:
        return None
    return PersistentTier.open(
        args.snapshot_dir,
        args.snapshot_max_mb << 20,
        args.policy,
        queue_size=args.snapshot_queue,
        preload=args.snapshot_preload,
    )
