"""The rounds of mlx_run_llm_batched through the services (``--engine ADDR [--prefix ADDR]``): same
prompts, seeds, files and report lines as in-process. With ``--prefix`` the gateway reuses prompts
across rounds (its own ``--max_entries`` bounds them); without, each generation runs cold."""

from __future__ import annotations

import argparse
import json
import os
import threading
from dataclasses import asdict, dataclass
from typing import TextIO

from clients.cli_options import gen_config
from clients.engine_client import EngineClient, GenerationOutcome
from clients.prefix_client import PrefixClient
from clients.round_output import COMPLETED, NAMESPACE, result_line
from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError
from engine_service.serving.tokens import read_token_file


@dataclass
class RemoteJob:
    number: int
    prompt: list[int]
    path: str
    outcome: GenerationOutcome | None = None
    error: str | None = None


def _run_job(job: RemoteJob, engine: EngineClient, prefix: PrefixClient | None, config: GenConfig) -> None:
    try:
        if prefix is not None:
            stream = prefix.generate(job.prompt, namespace=NAMESPACE, config=config)
        else:
            stream = engine.generate(job.prompt, config=config)
        job.outcome = stream.collect()
    except (ForklineError, ValueError) as exc:  # ValueError: a request field the proto cannot hold
        job.error = f"{type(exc).__name__}: {exc}"
    with open(job.path, "w", encoding="utf-8") as f:
        f.write(job.outcome.text if job.outcome is not None else "")


def report(job: RemoteJob, out: TextIO) -> bool:
    """Print the job's line (the in-process format); True when it completed."""
    done = job.outcome.done if job.outcome is not None else None
    if done is None:
        print(f"[{job.number}] failed: {job.error or 'stream ended without done'}", file=out, flush=True)
        return False
    line = result_line(
        job.number,
        done.prompt_positions + done.reused_positions,
        done.reused_positions,
        done.time_to_first_token_s,
        done.generated_tokens,
        done.decode_tokens_per_s,
        done.finish_reason,
        job.path,
    )
    print(line, file=out, flush=True)
    return done.finish_reason in COMPLETED


def run_remote(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``args.prompt_rounds`` rounds through the services; exit status like the in-process run."""
    owner = f"mlx_run_llm_batched-{os.getpid()}"
    token = read_token_file(args.token_file, "--token_file") if args.token_file else None
    credentials = {"token": token, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key}
    engine = EngineClient(args.engine, owner=owner, **credentials)
    prefix = PrefixClient(args.prefix, owner=owner, **credentials) if args.prefix else None
    try:
        engine.wait_ready()
        prompts = [
            engine.tokenize(text, chat=args.chat, add_special_tokens=not args.chat) for text in args.prompts
        ]
        completed = total = 0
        for round_ in range(args.prompt_rounds):
            jobs = [
                RemoteJob(round_ * len(prompts) + i, p, f"{args.out_prefix}_{round_ * len(prompts) + i}.txt")
                for i, p in enumerate(prompts)
            ]
            threads = [
                threading.Thread(target=_run_job, args=(job, engine, prefix, gen_config(args, args.seed + i)))
                for i, job in enumerate(jobs)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for job in jobs:
                completed += report(job, out)
                total += 1
        print(f"{completed}/{total} generations completed", file=out, flush=True)
        if args.metrics:
            print("engine " + json.dumps(asdict(engine.info())), file=out)
            if prefix is not None:
                print("prefix_cache " + json.dumps(asdict(prefix.stats())), file=out)
        return 0 if completed == total else 1
    finally:
        engine.close_channel()
        if prefix is not None:
            prefix.close_channel()
