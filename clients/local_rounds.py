"""The in-process rounds of mlx_run_llm_batched: Runner + ModuleExecutor + PrefixCache, no servers."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from clients.cli_options import UsageError, gen_config
from clients.round_output import COMPLETED, NAMESPACE, OutputFile, result_line
from clients.runner_backend import RunnerBackend
from clients.snapshot_dir import PersistentEntries
from engine_service.api.errors import ForklineError, ModelLoadError
from engine_service.api.prompts import TextPrompt, text_tokens
from engine_service.executors.module import ModuleExecutor
from engine_service.persistence.snapshot_key import read_snapshot_key
from engine_service.runtime.generation import GenerationHandle, GenerationResult
from engine_service.runtime.runner import Runner
from prefix_service.cache.capture import PromptCapture
from prefix_service.cache.prefix_cache import PrefixCache


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
        ids = text_tokens(
            TextPrompt(text, chat=args.chat, add_special_tokens=not args.chat), tokenizer, loaded.chat
        )
        if not ids:
            raise UsageError(f"prompt {i} encodes to no tokens")
        if len(ids) + args.max_new_tokens > args.max_session_tokens:
            raise UsageError(
                f"prompt {i} has {len(ids)} tokens; with --max_new_tokens {args.max_new_tokens} it "
                f"exceeds --max_session_tokens {args.max_session_tokens}"
            )
        prompts.append(ids)
    return prompts


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


@dataclass(frozen=True)
class Rig:
    """What every generation of the run shares."""

    args: argparse.Namespace
    runner: Runner
    cache: PrefixCache
    tokenizer: Any
    stop_tokens: tuple[int, ...]  # the model's EOS


def start(rig: Rig, n: int, prompt: list[int], seed: int, capture: bool) -> Job:
    """Look ``prompt`` up (a hit resumes from its clone) and start generation ``n`` on the engine thread."""
    args = rig.args
    output = OutputFile(f"{args.out_prefix}_{n}.txt", rig.tokenizer, args.flush_every)  # first: it may fail
    match = rig.cache.lookup(NAMESPACE, prompt).match
    session = match.session if match is not None else rig.runner.open_session()
    job = Job(n, prompt, match.reused if match is not None else 0, output)
    callback = output.on_update
    if capture:
        job.capture = rig.cache.capture_prompt(session, prompt)
        callback = job.capture.wrap(callback)
    config = gen_config(args, seed, rig.stop_tokens)
    job.handle = session.generate_async(prompt[job.reused :], config, callback)
    return job


def report(job: Job, out: TextIO) -> None:
    result = job.result
    if result is None:
        print(f"[{job.number}] failed to start: {job.error}", file=out)
        return
    m = result.metrics
    line = result_line(
        job.number,
        len(job.prompt),
        job.reused,
        m.time_to_first_token_s,
        m.generated_tokens,
        m.decode_tokens_per_s,
        result.finish_reason,
        job.output.path,
    )
    if result.error:
        line += f" ({result.error})"
    print(line, file=out, flush=True)


def run_round(rig: Rig, round_: int, prompts: list[list[int]], captured: int, out: TextIO) -> int:
    """Run every prompt concurrently, the first ``captured`` with prompt capture; how many completed."""
    jobs: list[Job] = []
    for i, prompt in enumerate(prompts):
        n = round_ * len(prompts) + i
        try:
            jobs.append(start(rig, n, prompt, rig.args.seed + i, i < captured))
        except ForklineError as exc:
            output = OutputFile(f"{rig.args.out_prefix}_{n}.txt", rig.tokenizer, 1)
            job = Job(n, prompt, 0, output, error=str(exc))
            job.output.close()
            jobs.append(job)
    for job in jobs:  # every generation of the round runs concurrently; wait for all
        if job.handle is not None:
            job.result = job.handle.wait()
            job.output.close()
    completed = 0
    for job in jobs:  # on this thread, after generation (never from a callback)
        if job.capture is not None:
            job.capture.collect(NAMESPACE)
        if job.handle is not None:
            job.handle.session.close()
        report(job, out)
        completed += job.result is not None and job.result.finish_reason in COMPLETED
    return completed


def run_local(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``args.prompt_rounds`` rounds in this process; 0 when every generation completed, else 1."""
    key = read_snapshot_key(args.snapshot_key) if args.snapshot_key else None  # before the model loads
    loaded, tokenizer, fingerprint = load(args)
    prompts = encode_prompts(args, loaded, tokenizer)
    count, entries = len(prompts), args.prefix_cache_entries
    captured = min(count, entries)
    executor = ModuleExecutor.create(
        loaded,
        args.cache_kind,
        max_sessions=count + entries + captured,  # the generations, the stored and the in-flight captures
        max_session_tokens=args.max_session_tokens,
        kv_dtype=args.kv_dtype,
        prefill_chunk=args.prefill_chunk,
        model_fingerprint=fingerprint,
        deterministic=args.deterministic,
    )
    runner = Runner(
        executor,
        max_decode_sequences=args.max_decode_sequences,
        shared_batch_tokens=args.shared_batch_tokens,
    )
    cache = PrefixCache(RunnerBackend(runner, key=key), entries, policy=args.retention)
    rig = Rig(args, runner, cache, tokenizer, tuple(tokenizer.eos_token_ids))
    store = PersistentEntries(args.snapshot_dir, cache, NAMESPACE) if args.snapshot_dir else None
    completed = total = 0
    try:
        if store is not None:
            store.restore(out)
        for round_ in range(args.prompt_rounds):
            completed += run_round(rig, round_, prompts, captured, out)
            total += count
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
