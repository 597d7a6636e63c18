"""The options that choose the model and build its executor, shared by every command that loads a model
(``forkline-engine``, ``mlx_run_llm_batched``, ``python -m engine_service.greedy``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine_service.api.checks import checked_int
from engine_service.api.errors import InvalidArgument

# --kv_dtype choices; auto: float16 where the attention reads half precision as stored (the compiled
# CPU kernel, or a GPU), float32 where it would upcast the cache every step (MLX's CPU ops)
KV_DTYPES = ("auto", "float16", "bfloat16", "float32")
# --speculative choices: off, or drafts looked up in the session's own history (prompt_lookup.py)
SPECULATIVE = ("off", "lookup", "suffix")


@dataclass(frozen=True)
class ExecutorSettings:
    """How an engine's executor and runner are built; the defaults are the service's (the engine's
    flags, ``ModuleExecutor.create`` and ``EngineSessions.build`` read them here)."""

    cache_kind: str = "batched-sequence"
    # a session costs only the positions it holds: the slot count does not bound a cache, memory does
    max_sessions: int = 256
    max_session_tokens: int = 8192  # at most the model's context: a 4k-token prompt and its answer fit
    kv_memory_mib: int = 0  # 0: auto (engine_service/executors/kv_memory.py)
    max_decode_sequences: int = 8
    prefill_chunk: int = 512
    # the cap on a forward in which a prompt ends (0: none); see runtime/scheduler.py
    shared_batch_tokens: int = 128
    kv_dtype: str = "auto"
    weights_dtype: str = "auto"
    speculative: str = "off"  # off, or lookup: prompt-lookup drafts verified in the same forward
    num_drafts: int = 4  # draft tokens per speculative step at most (+ 1 <= the executor's max_write)

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_session_tokens", "max_decode_sequences", "prefill_chunk"):
            checked_int(name, getattr(self, name), lo=1)
        checked_int("kv_memory_mib", self.kv_memory_mib, lo=0)
        checked_int("shared_batch_tokens", self.shared_batch_tokens, lo=0)
        checked_int("num_drafts", self.num_drafts, lo=1)
        if self.speculative not in SPECULATIVE:
            raise InvalidArgument(
                f"speculative must be one of {', '.join(SPECULATIVE)}, got {self.speculative!r}"
            )


DEFAULTS = ExecutorSettings()

# the per-session limits every executor command takes: flag, default, what it bounds
_LIMITS = (
    (
        "--max_session_tokens",
        DEFAULTS.max_session_tokens,
        "positions one session may hold, prompt and output together, at most the model's context "
        "(a larger value is capped there)",
    ),
    (
        "--max_decode_sequences",
        DEFAULTS.max_decode_sequences,
        "most sessions whose decode steps share one forward",
    ),
    ("--prefill_chunk", DEFAULTS.prefill_chunk, "prompt positions one forward writes per session"),
    (
        "--shared_batch_tokens",
        DEFAULTS.shared_batch_tokens,
        "positions at most of a forward in which a prompt ends while others run, decode steps "
        "included (prompts go shortest first): a short prompt's first token does not wait for "
        "another's long chunk; 0: no such cap",
    ),
)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--weights_dtype`` (what :func:`engine_service.model.loading.loader.load_model` takes)."""
    from engine_service.model.formats.weights import WEIGHTS_DTYPES
    from engine_service.model.loading.packaged import DEFAULT_MODEL, PACKAGED

    parser.add_argument(
        "--model",
        metavar="NAME|PATH",
        default=None,
        help=f"a packaged model ({', '.join(sorted(PACKAGED))}), a GGUF file or an MLX model "
        f"folder (default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--weights_dtype",
        default=DEFAULTS.weights_dtype,
        choices=WEIGHTS_DTYPES,
        help="weights in memory; auto: quantized on a GPU; on the CPU with the compiled kernels "
        "each matrix keeps its lossless block format (q4_1 for 4-bit sources, q8_0 for "
        "8-/5-bit ones, q8_0 requantized otherwise), float32 without (default: %(default)s)",
    )


def add_executor_options(parser: argparse.ArgumentParser, *, max_sessions: int | None) -> None:
    """The cache, limit, K/V dtype and ``--deterministic`` flags (``--max_sessions`` unless None)."""
    from engine_service.cache.registry import cache_kinds

    parser.add_argument(
        "--cache_kind",
        default=DEFAULTS.cache_kind,
        choices=cache_kinds(),
        help="KV cache: one buffer per sequence, or a shared pool of cells that clones share "
        "(default: %(default)s)",
    )
    if max_sessions is not None:
        parser.add_argument(
            "--max_sessions",
            metavar="N",
            type=int,
            default=max_sessions,
            help="resident sessions at most: requests, stored snapshots and clones in flight; an idle "
            "session costs only the positions it holds, so --kv_memory_mib is what bounds them "
            "(default: %(default)s)",
        )
    for flag, default, text in _LIMITS:
        parser.add_argument(
            flag, metavar="N", type=int, default=default, help=f"{text} (default: %(default)s)"
        )
    parser.add_argument(
        "--kv_memory_mib",
        metavar="MIB",
        type=int,
        default=DEFAULTS.kv_memory_mib,
        help="K/V memory of all sessions together, in MiB: the engine holds at most this over its "
        "bytes per position (every layer's K and V rows at --kv_dtype; Info reports both) and "
        "refuses more with RESOURCE_EXHAUSTED; 0: a quarter of the memory this process may use "
        "(physical, cgroup or accelerator, the least), at most 8 GiB "
        "(6 GiB on a 24 GiB machine: ~280k positions of SmolLM2-135M at float16, room for hundreds "
        "of cached prompts beside the weights) (default: %(default)s)",
    )
    parser.add_argument(
        "--kv_dtype",
        default=DEFAULTS.kv_dtype,
        choices=KV_DTYPES,
        help="K/V cache storage (snapshots and files too); auto: float16 where attention reads it as stored "
        "(the compiled CPU kernel, a GPU), float32 otherwise (default: %(default)s)",
    )
    parser.add_argument(
        "--speculative",
        default=DEFAULTS.speculative,
        choices=SPECULATIVE,
        help="speculative decoding: lookup drafts up to --num_drafts tokens from the session's own "
        "history, suffix also from the same owner's earlier requests where that has none, and "
        "verifies them in one forward; the output equals plain decoding (greedy, and "
        "seeded sampling token for token, under a json_schema too) (default: %(default)s)",
    )
    parser.add_argument(
        "--num_drafts",
        metavar="K",
        type=int,
        default=DEFAULTS.num_drafts,
        help="draft tokens per speculative step at most (K + 1 <= the cache's write budget) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant execution: a prefix hit, clone, chunked prefill or batched step gives "
        "bitwise the logits of a cold run alone (needs the compiled kernels and q8_0/q4_1 "
        "weights; fails at start otherwise; off by default)",
    )
