"""mlx_run_llm_batched's command line: its flags (:func:`build_parser`) and the checks that need no
model (:func:`validate`); bad arguments raise :class:`UsageError`."""

from __future__ import annotations

import argparse
import math
import os
from typing import NoReturn

from engine_service.api.config import GenConfig
from prefix_service.cache.retention import policy_names

DESCRIPTION = """mlx_run_llm_batched: run prompts concurrently in-process, reusing prompt snapshots across rounds.

In-process: Runner + ModuleExecutor + PrefixCache, no servers (or, with --engine, the same rounds
through a forkline-engine and optionally a forkline-prefix). Each round runs the P prompts
concurrently. Every generation first looks its prompt up in the prefix cache (a hit resumes from a
clone and replays only the suffix); the first min(P, E) prompts of every round are captured at their
prompt boundary while they generate and collected after the round. The engine reserves
P + E + min(P, E) resident sessions: the generations, the stored snapshots and the in-flight captures.

Generation n = round * P + i writes its text to <out_prefix>_<n>.txt (flushed every --flush_every
tokens) and prints one line: prompt positions, reused positions ("reused 41/42 prompt tokens"), time
to first token, decode tokens/s and the finish reason. Sampling generation i is seeded with seed + i
in every round, so rounds are comparable. Exit status: 0 when every generation completed, 1 when any
failed, 2 for bad arguments or an unloadable model (one line on stderr).
"""


class UsageError(Exception):
    """Bad command-line arguments: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage + error; we want one line
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from engine_service.executors.options import add_executor_options, add_model_options

    p = _Parser(
        prog="mlx_run_llm_batched",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt texts, run concurrently")
    add_model_options(p)
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        default=None,
        help="a tokenizer.json, or a folder holding one (default: the model's own tokenizer)",
    )
    add_executor_options(p, max_sessions=None)  # sized from the prompts and --prefix_cache_entries
    p.add_argument(
        "--prefix_cache_entries",
        metavar="N",
        type=int,
        default=0,
        help="prompt snapshots kept for reuse; 0: no reuse (default: %(default)s)",
    )
    p.add_argument(
        "--retention",
        default="lru",
        choices=policy_names(),
        help="which snapshot the prefix cache evicts when full (default: %(default)s)",
    )
    p.add_argument(
        "--prompt_rounds",
        metavar="N",
        type=int,
        default=1,
        help="times the whole prompt list runs (default: %(default)s)",
    )
    p.add_argument(
        "--max_new_tokens",
        metavar="N",
        type=int,
        default=128,
        help="most tokens generated per prompt (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        metavar="T",
        type=float,
        default=0.0,
        help="sampling temperature; 0: greedy (default: %(default)s)",
    )
    p.add_argument(
        "--top_p",
        metavar="P",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens with this much probability; "
        "1: off (default: %(default)s)",
    )
    p.add_argument(
        "--top_k",
        metavar="K",
        type=int,
        default=0,
        help="sample among the k most likely tokens only; 0: off (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        metavar="SEED",
        type=int,
        default=42,
        help="sampling seed of prompt 0; prompt i uses seed + i (default: %(default)s)",
    )
    p.add_argument(
        "--chat", action="store_true", help="apply the model's chat template to each prompt; off by default"
    )
    p.add_argument(
        "--out_prefix",
        metavar="PREFIX",
        default="gen",
        help="each generation writes <out_prefix>_<n>.txt (default: %(default)s)",
    )
    p.add_argument(
        "--flush_every",
        metavar="N",
        type=int,
        default=16,
        help="flush the output files every N tokens (default: %(default)s)",
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        help="print engine and prefix-cache counters at the end; off by default",
    )
    p.add_argument(
        "--snapshot_dir",
        default=None,
        metavar="DIR",
        help="keep the prefix cache's entries in DIR between runs: load them at start (each file "
        "checked: format, checksum, model fingerprint, cache kind, window geometry), write new "
        "ones after every round, remove evicted ones at the end; created if missing; needs "
        "--prefix_cache_entries (default: none, entries live as long as the run)",
    )
    p.add_argument(
        "--snapshot_key",
        default=None,
        metavar="FILE",
        help="sign the --snapshot_dir files with the secret in FILE (at least 32 bytes, mode 600 or "
        "640; a keyed MAC) and load only files it verifies: unsigned or forged ones are refused "
        "and removed (default: none, files are checksummed only, so the folder must be writable "
        "by you alone)",
    )
    p.add_argument(
        "--engine",
        default=None,
        metavar="ADDR",
        help="run through a forkline-engine at ADDR instead of in-process (default: in-process)",
    )
    p.add_argument(
        "--prefix",
        default=None,
        metavar="ADDR",
        help="with --engine: go through the forkline-prefix gateway at ADDR, which reuses prompts "
        "across rounds (default: none, every generation runs cold on the engine)",
    )
    p.add_argument(
        "--token_file",
        default=None,
        metavar="FILE",
        help="with --engine: a file holding the bearer token for services run with --auth_tokens "
        "(default: none, no token sent)",
    )
    p.add_argument(
        "--tls_ca",
        default=None,
        metavar="FILE",
        help="with --engine: PEM CA that signed the services' certificates; connect with TLS "
        "(default: none, plaintext)",
    )
    p.add_argument(
        "--tls_cert",
        default=None,
        metavar="FILE",
        help="with --tls_ca: PEM client certificate for services that require mutual TLS (default: none)",
    )
    p.add_argument(
        "--tls_key", default=None, metavar="FILE", help="PEM private key of --tls_cert (default: none)"
    )
    return p


def gen_config(args: argparse.Namespace, seed: int, stop_tokens: tuple[int, ...] = ()) -> GenConfig:
    """One prompt's sampling from the flags (prompt i is seeded with ``--seed + i``)."""
    return GenConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=seed,
        stop_tokens=stop_tokens,
        prefill_chunk=args.prefill_chunk,
    )


def validate(args: argparse.Namespace) -> None:
    """Argument checks that need no model; raises UsageError naming the flag."""
    for name in (
        "prompt_rounds",
        "max_decode_sequences",
        "max_session_tokens",
        "max_new_tokens",
        "prefill_chunk",
        "flush_every",
    ):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.prefix_cache_entries < 0:
        raise UsageError(f"--prefix_cache_entries must be >= 0, got {args.prefix_cache_entries}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UsageError(f"--top_k must be >= 0, got {args.top_k}")
    if not 0 <= args.seed < 2**64 - len(args.prompts):
        raise UsageError(f"--seed must be in [0, 2**64 - number of prompts), got {args.seed}")
    if args.engine and args.seed >= 2**63 - len(args.prompts):  # GenerationConfig.seed is an int64
        raise UsageError(f"--seed must be in [0, 2**63 - number of prompts) with --engine, got {args.seed}")
    if args.max_new_tokens >= args.max_session_tokens:
        raise UsageError(
            f"--max_new_tokens ({args.max_new_tokens}) must be below --max_session_tokens "
            f"({args.max_session_tokens}) to leave room for the prompt"
        )
    if args.snapshot_dir is not None:
        if args.engine:
            raise UsageError("--snapshot_dir runs in-process only, not with --engine")
        if args.prefix_cache_entries < 1:
            raise UsageError("--snapshot_dir needs --prefix_cache_entries >= 1")
        if os.path.exists(args.snapshot_dir) and not os.path.isdir(args.snapshot_dir):
            raise UsageError(f"--snapshot_dir: {args.snapshot_dir!r} is not a directory")
    elif args.snapshot_key is not None:
        raise UsageError("--snapshot_key needs --snapshot_dir")
    for flag in ("token_file", "tls_ca", "tls_cert", "tls_key"):
        if getattr(args, flag) and not args.engine:
            raise UsageError(f"--{flag} needs --engine")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls_cert and --tls_key must be given together")
    if args.tls_cert and not args.tls_ca:
        raise UsageError("--tls_cert needs --tls_ca")
    for i, text in enumerate(args.prompts):
        if not text:
            raise UsageError(f"prompt {i} is empty")
    out_dir = os.path.dirname(args.out_prefix) or "."
    if not os.path.isdir(out_dir):
        raise UsageError(f"--out_prefix: directory {out_dir!r} does not exist")
