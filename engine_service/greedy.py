"""Greedy generation from one prompt, streaming text to stdout: one sequence, no runner. Bad input
(a missing path, a corrupt GGUF, ...) prints one line "error: <path>: <problem>" and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from engine_service.api.checks import checked_int
from engine_service.api.errors import ForklineError, InvalidArgument
from engine_service.api.limits import check_nonempty, check_tokens
from engine_service.api.prompts import TextPrompt, text_tokens
from engine_service.cache.batch_control import BatchControl, Segment
from engine_service.executors.cache_setup import build_session_cache, cache_config
from engine_service.executors.options import add_model_options
from engine_service.model.loading.loader import LoadedModel, load_model
from engine_service.model.text.detokenizer import StreamDecoder
from engine_service.model.transformer import Transformer

log = logging.getLogger("engine_service.greedy")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    tokens: list[int] = field(default_factory=list)

    def summary(self) -> str:
        pre = self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0
        dec = (self.generated - 1) / self.decode_s if self.decode_s and self.generated > 1 else 0.0
        return f"{self.prompt_tokens} prompt tokens ({pre:.0f} tok/s), {self.generated} generated ({dec:.1f} tok/s)"


def new_cache(
    model: Transformer,
    max_tokens: int,
    *,
    kind: str = "batched-sequence",
    prefill_chunk: int = 512,
    max_seqs: int = 1,
    kv_dtype: str = "float32",
) -> BatchControl:
    """A cache for ``max_seqs`` sequences of ``max_tokens`` positions, as a ModuleExecutor builds it."""
    config = cache_config(
        model.config,
        max_sessions=max_seqs,
        max_session_tokens=max_tokens,
        max_write=prefill_chunk,
        kv_dtype=kv_dtype,
    )
    return build_session_cache(kind, config)


def prefill(
    model: Transformer, cache: BatchControl, seq: int, tokens: Sequence[int], chunk: int = 512
) -> mx.array:
    """Write ``tokens`` after ``pos(seq)`` in chunks: the lazy float32 logits [vocab] of the last one
    (InvalidArgument: ``api.limits``' rules)."""
    check_nonempty(len(tokens), "tokens")
    check_tokens(tokens, model.config.vocab_size)
    start = cache.pos(seq)
    for a in range(0, len(tokens), chunk):
        piece = tokens[a : a + chunk]
        step = cache.begin_step([Segment(seq, start + a, len(piece))])
        positions = mx.arange(start + a, start + a + len(piece), dtype=mx.int32)
        # lazy: the head is computed only for the final chunk's logits, which the caller evaluates
        logits = model(
            step,
            positions,
            tokens=mx.array(piece, dtype=mx.int32),
            logit_rows=mx.array([len(piece) - 1], dtype=mx.int32),
        )[0]
        if a + chunk < len(tokens):
            mx.eval(step.state())
    return logits


def greedy_tokens(
    model: Transformer,
    cache: BatchControl,
    seq: int,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop: Sequence[int] = (),
    *,
    chunk: int = 512,
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Greedy decode; yields each token as soon as it is known. Step n+1 is queued (``mx.async_eval``)
    before token n is read back, so the CPU is never idle waiting for Python."""
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    t0 = time.perf_counter()
    logits = prefill(model, cache, seq, prompt, chunk)
    token = mx.argmax(logits, keepdims=True).astype(mx.int32)  # [1]
    mx.eval(token)
    stats.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    pos = cache.pos(seq)
    stop_set = set(stop)
    for i in range(max_new_tokens):
        nxt = None
        if i + 1 < max_new_tokens:
            step = cache.begin_step([Segment(seq, pos, 1)])
            out = model(step, mx.array([pos], dtype=mx.int32), tokens=token)
            nxt = mx.argmax(out[0], keepdims=True).astype(mx.int32)
            mx.async_eval(nxt, *step.state())
            pos += 1
        value = token.item()
        stats.generated += 1
        stats.tokens.append(value)
        stats.decode_s = time.perf_counter() - t1
        yield value
        if value in stop_set or nxt is None:
            return
        token = nxt


def stream_text(
    loaded: LoadedModel,
    prompt: str,
    *,
    chat: bool = True,
    max_new_tokens: int = 128,
    out=sys.stdout,
    stats: GenerationStats | None = None,
) -> GenerationStats:
    """Format, tokenize and generate greedily, writing text to ``out`` as it completes."""
    checked_int("max_new_tokens", max_new_tokens, lo=1)
    tok = loaded.tokenizer
    ids = text_tokens(TextPrompt(prompt, chat=chat, add_special_tokens=not chat), tok, loaded.chat)
    check_nonempty(len(ids), "prompt")
    total = len(ids) + max_new_tokens
    if total > loaded.config.context_length:
        raise InvalidArgument(
            f"prompt ({len(ids)}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context length {loaded.config.context_length}"
        )
    cache = new_cache(loaded.model, total)
    seq = cache.seq_new()
    stats = stats if stats is not None else GenerationStats()
    decoder = StreamDecoder(tok, skip_special_tokens=True)
    for token in greedy_tokens(loaded.model, cache, seq, ids, max_new_tokens, tok.eos_token_ids, stats=stats):
        if token in tok.eos_token_ids:
            break
        out.write(decoder.push(token))
        out.flush()
    out.write(decoder.flush())
    out.flush()
    return stats


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine_service.greedy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(parser)
    parser.add_argument(
        "--max_new_tokens",
        metavar="N",
        type=int,
        default=128,
        help="most tokens to generate (default: %(default)s)",
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="format the prompt with the model's chat template (default: on)",
    )
    parser.add_argument("prompt", nargs="+", help="the prompt; several words are joined with spaces")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        loaded = load_model(args.model, args.weights_dtype)
        stats = stream_text(loaded, " ".join(args.prompt), chat=args.chat, max_new_tokens=args.max_new_tokens)
    except (ForklineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, like other CLI tools
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 0
    print(file=sys.stdout)
    log.info("%s", stats.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
