"""StepCosts: a forward's fixed cost over one more row's (``fixed + rows x per_row``), fitted online by
weighted least squares from the intervals between back-to-back decode-only steps, for the draft
decisions of ``PromptLookupExecutor``; the prior until the row counts seen spread, then the last fit.
Why and how: docs/ENGINE.md (Where drafts pay)."""

from __future__ import annotations

from engine_service.api.checks import checked_float

PRIOR_RATIO = 4.0  # 2-core EPYC, SmolLM2: ~8 ms a forward beside ~2 ms a row
DECAY = 0.99  # weight of an older step per newer one (~100 steps' memory)
MIN_WEIGHT = 16.0  # steps (weighted) before a fit counts
MIN_SPREAD = 0.5  # variance of the row counts seen (rows^2) before a fit counts
OUTLIER = 4.0  # an interval above this many times the fitted one is a pause, not a step
RATIO_RANGE = (1.0, 16.0)  # a 1-row step costs at least one row more (the weights' read)


class StepCosts:
    """``observe(rows, seconds)`` per step; ``ratio`` is fixed / per-row cost (``prior`` until fitted)."""

    def __init__(self, prior: float = PRIOR_RATIO) -> None:
        self.prior = checked_float("prior", prior, lo=RATIO_RANGE[0])
        self._sums = [0.0] * 5  # weighted: 1, r, t, r^2, r t
        self._fit: tuple[float, float] | None = None  # (fixed, per_row) seconds, the last one that counted
        self.observed = 0  # steps observed (outliers excluded)

    @property
    def ratio(self) -> float:
        if self._fit is None:
            return self.prior
        fixed, per_row = self._fit
        return min(max(fixed / per_row, RATIO_RANGE[0]), RATIO_RANGE[1])

    def predict(self, rows: int) -> float | None:
        """The fitted seconds of a ``rows``-row step (None before a fit)."""
        return None if self._fit is None else self._fit[0] + rows * self._fit[1]

    def observe(self, rows: int, seconds: float) -> None:
        predicted = self.predict(rows)
        if rows < 1 or seconds <= 0 or (predicted is not None and seconds > OUTLIER * predicted):
            return
        self.observed += 1
        sums = [s * DECAY for s in self._sums]
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            sums[i] += v
        self._sums = sums
        w, r, t, rr, rt = sums
        spread = rr / w - (r / w) ** 2
        if w < MIN_WEIGHT or spread < MIN_SPREAD:
            return
        per_row = (rt / w - (r / w) * (t / w)) / spread
        fixed = t / w - per_row * r / w
        if per_row > 0 and fixed > 0:
            self._fit = (fixed, per_row)
