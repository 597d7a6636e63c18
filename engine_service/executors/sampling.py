"""Sampling parameters and the seeded per-generation sampler.

The filter order is the one most servers use: scale by ``1 / temperature``, keep the ``top_k`` largest
logits, then keep the smallest set of the remaining tokens (by decreasing probability, renormalised
over the top-k set) whose cumulative probability reaches ``top_p``. The most likely token always
survives. Ties at the k-th largest logit are all kept (a threshold, not an index cut).

Two per-generation extras, both off (and free) unless asked for: a grammar (``GenConfig.grammar``)
masks each draw to the tokens it allows (greedy takes the argmax of the allowed ones), and
``top_logprobs`` reports log probabilities (:mod:`.token_logprobs`). Either one makes the draw need the
host between steps (the mask depends on the previous token), so the executor runs such a session
without a decode lookahead or drafts (:attr:`Sampler.needs_host`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine_service.api.checks import checked_float, checked_int
from engine_service.api.config import GenConfig, TokenGrammar
from engine_service.api.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 disables top-k; top_p 1.0 disables nucleus sampling;
    top_logprobs None reports no log probabilities; grammar None leaves every token allowed."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    top_logprobs: int | None = None
    grammar: TokenGrammar | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        checked_float("temperature", self.temperature, lo=0.0)
        checked_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        checked_int("top_k", self.top_k, lo=0)

    @classmethod
    def of(cls, config: GenConfig) -> SamplingParams:
        """The sampling parameters of one generation's config (a ``json_schema`` the engine did not
        compile into ``grammar`` is refused: see ``executors.grammar.with_grammar``)."""
        if config.json_schema and config.grammar is None:
            raise InvalidArgument("json_schema is set but not compiled (executors.grammar.with_grammar)")
        return cls(
            temperature=float(config.temperature),
            top_p=float(config.top_p),
            top_k=config.top_k,
            top_logprobs=config.top_logprobs,
            grammar=config.grammar,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_SEED_MASK = (1 << 64) - 1


class Sampler:
    """Draws tokens for one generation, reproducibly: the same seed gives the same tokens.

    The PRNG key is ``mx.random.key(seed)`` split once per :meth:`sample` call, so draw ``n`` depends
    only on the seed, ``n`` and the logits. Everything stays lazy on the device; the caller evaluates
    the returned tokens together with :attr:`key` (the advanced key) in its one ``mx.eval`` per step,
    which keeps the key's graph from growing across steps.
    """

    __slots__ = ("params", "seed", "_key", "_matcher")

    def __init__(self, params: SamplingParams, seed: int = 0) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"Sampler.params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(seed, int):
            raise ValueError(f"Sampler.seed must be an int, got {seed!r}")
        self.params = params
        self.seed = seed
        self._key = mx.random.key(seed & _SEED_MASK)
        self._matcher: Any = None if params.grammar is None else params.grammar.matcher()

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def per_row(self) -> bool:
        """Whether this session's row is drawn on its own (sampled, or masked), not in the batch's
        shared argmax."""
        return not self.params.greedy or self._matcher is not None

    @property
    def needs_host(self) -> bool:
        """Whether each draw needs the host first or after (a grammar's mask, log probabilities)."""
        return self._matcher is not None or self.params.top_logprobs is not None

    def observe(self, tokens: Sequence[int]) -> None:
        """Tell the grammar the tokens this sampler drew (read back), in order; no-op without one."""
        if self._matcher is not None:
            for token in tokens:
                self._matcher.consume(token)

    @property
    def key(self) -> mx.array:
        """The current PRNG key (uint32 [2]); evaluate it with the tokens of the step."""
        return self._key

    def restore_key(self, key: mx.array) -> None:
        """Put back a key :attr:`key` returned earlier (a draw that is discarded, never delivered)."""
        self._key = key

    def filtered_logits(self, logits: mx.array) -> mx.array:
        """Temperature-scaled logits (each row's max shifted to 0) with filtered-out tokens at -inf.

        logits: float [..., vocab] -> float32 [..., vocab]. ``softmax`` of the result is the
        distribution :meth:`sample` draws from. Greedy params (temperature 0) apply no scaling.
        """
        p = self.params
        x = logits.astype(mx.float32)
        if not p.greedy:
            # Shift each row's max to 0 first: a tiny temperature then sends the other logits to -inf
            # instead of overflowing the leaders to +inf (a uniform draw among them); the where keeps
            # 0 / 0 from making NaN when the temperature underflows float32.
            shifted = x - mx.max(x, axis=-1, keepdims=True)
            x = mx.where(shifted == 0, shifted, shifted / p.temperature)
        vocab = x.shape[-1]
        neg_inf = mx.array(-mx.inf, dtype=mx.float32)
        if 0 < p.top_k < vocab:
            # the k-th largest value: sort ascending, index vocab - k
            kth = mx.sort(x, axis=-1)[..., vocab - p.top_k : vocab - p.top_k + 1]
            x = mx.where(x < kth, neg_inf, x)
        if p.top_p < 1.0:
            order = mx.argsort(-x, axis=-1)  # decreasing logits
            sorted_x = mx.take_along_axis(x, order, axis=-1)
            probs = mx.softmax(sorted_x, axis=-1)
            before = mx.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each token
            keep_sorted = before < p.top_p  # the first token has 0 ahead: always kept
            keep = mx.take_along_axis(keep_sorted, mx.argsort(order, axis=-1), axis=-1)
            x = mx.where(keep, x, neg_inf)
        return x

    def sample(self, logits: mx.array) -> mx.array:
        """Draw one token per row, lazily.

        logits: float [vocab] or [R, vocab] -> int32 [] or [R]. Greedy is the argmax and does not
        advance the key; otherwise one key split per call (the same subkey serves every row). With a
        grammar, the tokens it does not allow now are at -inf first (one mask for every row).
        """
        if self._matcher is not None:
            allowed = self._matcher.mask(logits.shape[-1])
            logits = mx.where(allowed, logits.astype(mx.float32), mx.array(-mx.inf, dtype=mx.float32))
        if self.params.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(self.filtered_logits(logits), axis=-1, key=sub).astype(mx.int32)
