"""Log probabilities in OpenAI's two shapes: chat's ``logprobs.content`` and the legacy completions'
parallel lists; the values are the engine's (log-softmax of the raw logits, before temperature)."""

from __future__ import annotations

from collections.abc import Sequence

from engine_service.api.logprobs import LogprobEntry, TokenLogprob
from prefix_service.http.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


def _top(entry: LogprobEntry) -> TopLogprob:
    return TopLogprob(token=entry.text, logprob=entry.logprob, bytes=list(entry.raw))


def chat_logprobs(values: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=v.chosen.text,
                logprob=v.chosen.logprob,
                bytes=list(v.chosen.raw),
                top_logprobs=[_top(e) for e in v.top],
            )
            for v in values
        ]
    )


def completion_logprobs(values: Sequence[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    """``offset``: where the first token's text starts in the choice's text (a stream's later chunk)."""
    offsets = []
    for v in values:
        offsets.append(offset)
        offset += len(v.chosen.text)
    return CompletionLogprobs(
        tokens=[v.chosen.text for v in values],
        token_logprobs=[v.chosen.logprob for v in values],
        top_logprobs=[{e.text: e.logprob for e in v.top} for v in values],
        text_offset=offsets,
    )
