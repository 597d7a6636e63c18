"""What every mlx_run_llm_batched generation leaves: its ``<out_prefix>_<n>.txt`` file and one report line."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TextIO

from engine_service.api.stream_events import FinishReason

if TYPE_CHECKING:
    from engine_service.runtime.generation import GenerationUpdate

NAMESPACE = "mlx_run_llm_batched"  # the prefix cache namespace of every prompt
COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)


def result_line(
    number: int,
    prompt: int,
    reused: int,
    ttft_s: float | None,
    tokens: int,
    decode_tps: float,
    finish: str,
    path: str,
) -> str:
    """``[n] prompt P positions, reused R/P prompt tokens, ttft ..., finish F -> path``."""
    ttft = f"{ttft_s:.3f} s" if ttft_s is not None else "n/a"
    return (
        f"[{number}] prompt {prompt} positions, reused {reused}/{prompt} prompt tokens, ttft {ttft}, "
        f"{tokens} tokens at {decode_tps:.1f} tok/s decode, finish {finish} -> {path}"
    )


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
