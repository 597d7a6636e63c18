"""mlx_run_llm_batched: run prompts concurrently in-process, reusing prompt snapshots across rounds.

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

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import NoReturn, TextIO

from clients.snapshot_dir import PersistentEntries
from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError, InvalidArgument, ModelLoadError
from engine_service.api.stream_events import FinishReason
from engine_service.executors.module import ModuleExecutor
from engine_service.persistence.snapshot_key import read_snapshot_key
from engine_service.runtime.generation import GenerationHandle, GenerationResult, GenerationUpdate
from engine_service.runtime.runner import Runner
from engine_service.sessions.local_backend import RunnerBackend
from prefix_service.cache.capture import PromptCapture
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.cache.retention import policy_names

NAMESPACE = "mlx_run_llm_batched"
COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


class UsageError(Exception):
    """Bad command-line arguments: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage + error; we want one line
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from engine_service.executors.options import add_executor_options, add_model_options

    p = _Parser(
        prog="mlx_run_llm_batched", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
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


def load(args: argparse.Namespace):
    """(loaded model, tokenizer, model fingerprint). Raises ModelLoadError."""
    from engine_service.model.loading.loader import load_model
    from engine_service.model.text.tokenizer import tokenizer_from_file

    loaded = load_model(args.model, args.weights_dtype)
    if args.tokenizer is None:
        return loaded, loaded.tokenizer, loaded.fingerprint
    path = args.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelLoadError(args.tokenizer, "no tokenizer.json there")
    tokenizer = tokenizer_from_file(
        path, bos_token_id=loaded.config.bos_token_id, eos_token_ids=loaded.config.eos_token_ids
    )
    if tokenizer.vocab_size > loaded.config.vocab_size:
        raise ModelLoadError(
            path, f"tokenizer has {tokenizer.vocab_size} tokens, the model only {loaded.config.vocab_size}"
        )
    digest = hashlib.sha256(loaded.fingerprint.encode() + tokenizer.vocab_digest_source()).hexdigest()
    return loaded, tokenizer, digest


def encode_prompts(args: argparse.Namespace, loaded, tokenizer) -> list[list[int]]:
    prompts = []
    for i, text in enumerate(args.prompts):
        if args.chat:
            ids = tokenizer.encode(loaded.chat.format([{"role": "user", "content": text}]))
        else:
            ids = tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise UsageError(f"prompt {i} encodes to no tokens")
        if len(ids) + args.max_new_tokens > args.max_session_tokens:
            raise UsageError(
                f"prompt {i} has {len(ids)} tokens; with --max_new_tokens {args.max_new_tokens} it "
                f"exceeds --max_session_tokens {args.max_session_tokens}"
            )
        prompts.append(ids)
    return prompts


class OutputFile:
    """Streams one generation's text to a file; written on the engine thread, closed by either side."""

    def __init__(self, path: str, tokenizer, flush_every: int) -> None:
        from engine_service.model.text.detokenizer import StreamDecoder

        self.path = path
        self._file: TextIO | None = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
        self._flush_every = flush_every
        self._unflushed = 0
        self._lock = threading.Lock()

    def on_update(self, update: GenerationUpdate) -> None:
        with self._lock:
            if self._file is None:
                return
            if update.tokens:
                self._file.write(self._decoder.push_many(update.tokens))
                self._unflushed += len(update.tokens)
                if self._unflushed >= self._flush_every:
                    self._file.flush()
                    self._unflushed = 0
        if update.finished:
            self.close()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write(self._decoder.flush())
                self._file.close()
                self._file = None


@dataclass
class Job:
    """One generation of a round."""

    number: int
    prompt: list[int]
    reused: int
    output: OutputFile
    handle: GenerationHandle | None = None
    capture: PromptCapture | None = None
    result: GenerationResult | None = None
    error: str | None = None


def start(
    n: int,
    prompt: list[int],
    seed: int,
    args,
    runner: Runner,
    cache: PrefixCache,
    tokenizer,
    capture: bool,
    stop_tokens: tuple[int, ...],
) -> Job:
    output = OutputFile(f"{args.out_prefix}_{n}.txt", tokenizer, args.flush_every)  # first: it may fail
    match = cache.lookup(NAMESPACE, prompt).match
    session = match.session if match is not None else runner.open_session()
    job = Job(n, prompt, match.reused if match is not None else 0, output)
    callback = output.on_update
    if capture:
        job.capture = cache.capture_prompt(session, prompt)
        callback = job.capture.wrap(callback)
    config = GenConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=seed,
        stop_tokens=stop_tokens,
        prefill_chunk=args.prefill_chunk,
    )
    job.handle = session.generate_async(prompt[job.reused :], config, callback)
    return job


def report(job: Job, out: TextIO) -> None:
    result = job.result
    if result is None:
        print(f"[{job.number}] failed to start: {job.error}", file=out)
        return
    m = result.metrics
    ttft = f"{m.time_to_first_token_s:.3f} s" if m.time_to_first_token_s is not None else "n/a"
    line = (
        f"[{job.number}] prompt {len(job.prompt)} positions, reused {job.reused}/{len(job.prompt)} prompt "
        f"tokens, ttft {ttft}, {m.generated_tokens} tokens at {m.decode_tokens_per_s:.1f} tok/s decode, "
        f"finish {result.finish_reason} -> {job.output.path}"
    )
    if result.error:
        line += f" ({result.error})"
    print(line, file=out, flush=True)


def run(args: argparse.Namespace, out: TextIO) -> int:
    key = read_snapshot_key(args.snapshot_key) if args.snapshot_key else None  # before the model loads
    loaded, tokenizer, fingerprint = load(args)
    prompts = encode_prompts(args, loaded, tokenizer)
    count, entries = len(prompts), args.prefix_cache_entries
    captured = min(count, entries)
    executor = ModuleExecutor.create(
        loaded,
        args.cache_kind,
        max_sessions=count + entries + captured,
        max_session_tokens=args.max_session_tokens,
        kv_dtype=args.kv_dtype,
        prefill_chunk=args.prefill_chunk,
        model_fingerprint=fingerprint,
        deterministic=args.deterministic,
    )
    runner = Runner(executor, max_decode_sequences=args.max_decode_sequences)
    cache = PrefixCache(RunnerBackend(runner, key=key), entries, policy=args.retention)
    stop_tokens = tuple(tokenizer.eos_token_ids)
    store = PersistentEntries(args.snapshot_dir, cache, NAMESPACE) if args.snapshot_dir else None
    completed = total = 0
    try:
        if store is not None:
            store.restore(out)
        for round_ in range(args.prompt_rounds):
            jobs: list[Job] = []
            for i, prompt in enumerate(prompts):
                n = round_ * count + i
                try:
                    jobs.append(
                        start(
                            n,
                            prompt,
                            args.seed + i,
                            args,
                            runner,
                            cache,
                            tokenizer,
                            i < captured,
                            stop_tokens,
                        )
                    )
                except ForklineError as exc:
                    job = Job(
                        n, prompt, 0, OutputFile(f"{args.out_prefix}_{n}.txt", tokenizer, 1), error=str(exc)
                    )
                    job.output.close()
                    jobs.append(job)
            for job in jobs:  # every generation of the round runs concurrently; wait for all
                if job.handle is not None:
                    job.result = job.handle.wait()
                    job.output.close()
            for job in jobs:  # on this thread, after generation (never from a callback)
                if job.capture is not None:
                    job.capture.collect(NAMESPACE)
                if job.handle is not None:
                    job.handle.session.close()
                report(job, out)
                total += 1
                completed += job.result is not None and job.result.finish_reason in COMPLETED
            if store is not None:
                store.persist()
        if store is not None:
            store.finish(out)
        print(f"{completed}/{total} generations completed", file=out, flush=True)
        if args.metrics:
            print("engine " + json.dumps(asdict(runner.metrics())), file=out)
            print("prefix_cache " + json.dumps(asdict(cache.stats())), file=out)
    finally:
        cache.clear()
        runner.shutdown()
    return 0 if completed == total else 1


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
        return run(args, sys.stdout)
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
