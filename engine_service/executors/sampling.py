"""Sampling parameters and the seeded per-generation sampler: temperature, then top-k (ties at the k-th
logit kept), then top-p over the renormalised rest; the most likely token always survives. A grammar
mask or ``top_logprobs`` make a draw need the host between steps (:attr:`Sampler.needs_host`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine_service.api.checks import checked_float, checked_int
from engine_service.api.config import GenConfig, TokenGrammar
from engine_service.api.errors import InvalidArgument
from engine_service.model.cpu_kernels import kernels


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0: greedy; top_k 0 and top_p 1.0: off; grammar None: every token allowed."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    top_logprobs: int | None = None
    grammar: TokenGrammar | None = field(default=None, compare=False)
    # a resume: the tokens an earlier attempt of this generation drew (GenConfig.drawn_tokens); the
    # sampler starts that many draws on and its grammar has consumed them
    drawn: tuple[int, ...] = field(default=(), compare=False)
    drafts: bool = True  # GenConfig.speculative != "off": a speculative executor may draft for it
    scope: str = field(default="", compare=False)  # GenConfig.draft_scope: whose earlier texts may draft

    def __post_init__(self) -> None:
        checked_float("temperature", self.temperature, lo=0.0)
        checked_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        checked_int("top_k", self.top_k, lo=0)

    @classmethod
    def of(cls, config: GenConfig, drawn: Sequence[int] = ()) -> SamplingParams:
        """One generation's sampling (a ``json_schema`` not compiled into ``grammar`` is refused);
        ``drawn``: the ids of its ``drawn_tokens``."""
        if config.json_schema and config.grammar is None:
            raise InvalidArgument("json_schema is set but not compiled (executors.grammar.with_grammar)")
        return cls(
            temperature=float(config.temperature),
            top_p=float(config.top_p),
            top_k=config.top_k,
            top_logprobs=config.top_logprobs,
            grammar=config.grammar,
            drawn=tuple(drawn),
            drafts=config.speculative != "off",
            scope=config.draft_scope,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_SEED_MASK = (1 << 64) - 1


def categorical_kernel() -> Any:
    """``forkline_kernels.categorical`` when the compiled kernels load and MLX computes on the CPU,
    else None (MLX's own categorical)."""
    if mx.default_device() != mx.cpu:
        return None
    ext = kernels()
    return None if ext is None else getattr(ext, "categorical", None)


class Sampler:
    """Draws one generation's tokens reproducibly: the key ``mx.random.key(seed)`` is split once per
    :meth:`sample`, so the n-th draw's key is a function of (seed, n) alone and a resumed generation
    (``params.drawn``: n tokens drawn elsewhere) starts n splits on; the caller evaluates the tokens
    with :attr:`key` in its one ``mx.eval`` per step."""

    __slots__ = ("params", "seed", "_key", "_matcher", "_draw_keys")

    def __init__(self, params: SamplingParams, seed: int = 0) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"Sampler.params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(seed, int):
            raise ValueError(f"Sampler.seed must be an int, got {seed!r}")
        self.params = params
        self.seed = seed
        self._key = mx.random.key(seed & _SEED_MASK)
        self._matcher: Any = None if params.grammar is None else params.grammar.matcher()
        self._draw_keys: list[mx.array] = []  # the keys after each row of :meth:`sample_draws`
        if params.drawn and not params.greedy:  # greedy draws never split the key
            for _ in params.drawn:
                self._key, _sub = mx.random.split(self._key)
            mx.eval(self._key)
        self.observe(params.drawn)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def per_row(self) -> bool:
        """Whether this row is drawn on its own (sampled or masked), not in the batch's argmax."""
        return not self.params.greedy or self._matcher is not None

    @property
    def masked(self) -> bool:
        """Whether a grammar masks each draw."""
        return self._matcher is not None

    def draft_masks(self, drafts: tuple[int, ...], vocab: int) -> tuple[tuple[int, ...], mx.array | None]:
        """(the drafts the grammar allows, the masks of their verification rows); (drafts, None) without
        a grammar."""
        if self._matcher is None:
            return drafts, None
        return self._matcher.draft_masks(drafts, vocab)

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
        """float [..., vocab] -> float32 [..., vocab]: scaled (max shifted to 0), filtered-out tokens at -inf."""
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
        """float [vocab] or [R, vocab] -> int32 [] or [R], lazily. Greedy: the argmax, the key unchanged;
        else one key split per call. A grammar's disallowed tokens are at -inf first."""
        if self._matcher is not None:
            allowed = self._matcher.mask(logits.shape[-1])
            logits = mx.where(allowed, logits.astype(mx.float32), mx.array(-mx.inf, dtype=mx.float32))
        if self.params.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        self._key, sub = mx.random.split(self._key)
        if logits.ndim == 1:
            return self.draw(logits[None], sub)[0]
        return self.draw(logits, sub)

    def draw(self, logits: mx.array, key: mx.array) -> mx.array:
        """float [R, vocab] -> int32 [R], lazily, one draw per row from ``key``: the compiled kernel's
        inverse-CDF draw (one uniform per row: ``forkline_kernels.categorical``) on the CPU, MLX's Gumbel
        draw elsewhere. The temperature and filters are applied here; a grammar's mask comes before."""
        ext = categorical_kernel()
        if ext is None:
            return mx.random.categorical(self.filtered_logits(logits), axis=-1, key=key).astype(mx.int32)
        p = self.params
        if p.top_k == 0 and p.top_p >= 1.0:  # unfiltered: the kernel scales by the temperature itself
            # a tiny temperature: 1 / t is inf as a float32, every logit below the maximum weighs 0
            x, inv_temperature = logits.astype(mx.float32), 1.0 / p.temperature
        else:
            x, inv_temperature = self.filtered_logits(logits), 1.0
        uniforms = mx.random.uniform(shape=(x.shape[0],), key=key)
        return ext(x, uniforms, inv_temperature=inv_temperature)

    def sample_draws(self, logits: mx.array, masks: mx.array | None = None) -> mx.array:
        """float [R, vocab] -> int32 [R], lazily: speculative verification. Row j is drawn exactly as
        the (j+1)-th draw from now would be in plain decoding (under the grammar's mask after the
        drafts before it: ``masks`` bool [R, vocab]; its own key split, its own [1, vocab] draw), so
        where the drafts equal the draws the tokens are plain decoding's; the key moves on by the
        draws :meth:`accept_draws` keeps (all R until then)."""
        if masks is not None:
            logits = mx.where(masks, logits.astype(mx.float32), mx.array(-mx.inf, dtype=mx.float32))
        if self.params.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        rows, key, self._draw_keys = [], self._key, []
        for j in range(logits.shape[0]):
            key, sub = mx.random.split(key)
            rows.append(self.draw(logits[j : j + 1], sub))
            self._draw_keys.append(key)
        self._key = key
        return mx.concatenate(rows).astype(mx.int32)

    @property
    def draw_keys(self) -> list[mx.array]:
        """The keys :meth:`sample_draws` queued (evaluate them with the step's tokens)."""
        return list(self._draw_keys)

    def accept_draws(self, count: int) -> None:
        """Keep the first ``count`` (>= 1) draws of the last :meth:`sample_draws`: the key is the one
        after them, as if plain decoding had drawn ``count`` tokens."""
        keys, self._draw_keys = self._draw_keys, []
        if keys:
            self._key = keys[count - 1]
