"""One planned batch on the engine thread: run the forward, commit what it wrote, emit each
generation's update, and finish generations once (``Delivery.finish``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_service.api.errors import GenerationError
from engine_service.api.logprobs import TokenLogprob
from engine_service.api.stream_events import FinishReason
from engine_service.executors.base import ExecOutput, Executor
from engine_service.runtime.generation import GenerationUpdate
from engine_service.runtime.scheduler import BatchPlan, PlannedInput
from engine_service.runtime.state import ActiveGeneration

if TYPE_CHECKING:
    from engine_service.runtime.engine_loop import EngineLoop

log = logging.getLogger(__name__)

# Called on the engine thread after every forward with (rows, positions, seconds): the inputs in the
# batch, the positions they fed, and the wall time of ``executor.execute``. Must be cheap and not raise.
BatchObserver = Callable[[int, int, float], None]


class Delivery:
    """The batch step of one :class:`EngineLoop` (engine thread only)."""

    def __init__(self, loop: EngineLoop, executor: Executor) -> None:
        self._loop = loop
        self._executor = executor

    def run(self, plan: BatchPlan) -> None:
        counts = self._loop.counts
        counts["forward_batches"] += 1
        started = time.perf_counter()
        try:
            outputs = self._executor.execute([p.input for p in plan.inputs])
            if len(outputs) != len(plan.inputs):
                raise GenerationError(
                    f"executor returned {len(outputs)} outputs for {len(plan.inputs)} inputs"
                )
        except Exception as exc:
            # A failed batch poisons every session in it; other sessions and the engine carry on.
            counts["failed_batches"] += 1
            log.warning("batch of %d inputs failed: %s", len(plan.inputs), exc)
            for item in plan.inputs:
                item.gen.record.poisoned = True
                self.finish(
                    item.gen,
                    FinishReason.ERROR,
                    GenerationError(f"executor failed: {type(exc).__name__}: {exc}"),
                )
            return
        observer = self._loop.batch_observer
        if observer is not None:
            _observe(observer, plan, time.perf_counter() - started)
        for item, out in zip(plan.inputs, outputs, strict=True):
            if not item.gen.finished:
                self._deliver(item, out)

    def _deliver(self, item: PlannedInput, out: ExecOutput) -> None:
        gen, rec = item.gen, item.gen.record
        if out.error is not None or (item.input.want_output and not out.tokens):
            rec.poisoned = True
            self.finish(
                gen, FinishReason.ERROR, GenerationError(out.error or "executor returned no prediction")
            )
            return
        # The input is committed; a continuing generation's pending token was its first position.
        rec.content.commit(item.input.start, item.input.tokens, item.input.size())
        rec.position = item.input.start + item.input.size()
        rec.pending = None
        if not item.decode:
            self._loop.counts["prefill_positions"] += item.input.size()
        breakpoint = rec.position if rec.position in item.breakpoints else None
        if not item.input.want_output:
            self._emit(gen, GenerationUpdate((), rec.position, breakpoint=breakpoint))
            return
        if gen.first_token_at is None:
            gen.first_token_at = time.perf_counter()
        tokens, reason, rec.position, rec.pending = gen.accept(tuple(out.tokens), rec.position)
        logprobs = () if out.logprobs is None else tuple(out.logprobs[: len(tokens)])
        rec.content.extend(tokens[:-1])  # accepted drafts are committed; the last token is pending
        self._loop.counts["tokens_decoded"] += len(tokens)
        if breakpoint is not None and breakpoint != rec.position:
            # Accepted speculative drafts moved the position past the breakpoint: report it on an
            # update of its own first, so an observer can still clone exactly there.
            self._emit(gen, GenerationUpdate((), breakpoint, breakpoint=breakpoint))
            if gen.finished:
                return
            breakpoint = None
        if reason is None and rec.position >= self._loop.limits.max_session_tokens:
            reason = FinishReason.LENGTH  # the pending token has no room left in the session
        if reason is not None:
            self.finish(gen, reason, tokens=tokens, breakpoint=breakpoint, logprobs=logprobs)
        else:
            self._emit(gen, GenerationUpdate(tokens, rec.position, breakpoint=breakpoint, logprobs=logprobs))

    def _emit(self, gen: ActiveGeneration, update: GenerationUpdate) -> None:
        if gen.callback is None:
            return
        try:
            gen.callback(update)
        except Exception as exc:
            gen.callback = None  # a raising callback is not called again, not even for the end
            self.finish(
                gen, FinishReason.ERROR, GenerationError(f"callback raised {type(exc).__name__}: {exc}")
            )

    def finish(
        self,
        gen: ActiveGeneration,
        reason: FinishReason,
        error: BaseException | None = None,
        *,
        tokens: tuple[int, ...] = (),
        breakpoint: int | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        """End ``gen`` once: free its session for the next generation, send the terminal update, settle."""
        if gen.finished:
            return
        gen.finished = True
        if gen in self._loop.active:
            self._loop.active.remove(gen)
        rec = gen.record
        if rec is not None and rec.generation is gen:
            rec.generation = None
            rec.busy = False
        self._loop.counts["generations_finished"] += 1
        result = gen.result(reason, error)
        position = rec.position if rec is not None else 0
        if gen.callback is not None:
            update = GenerationUpdate(
                tokens,
                position,
                breakpoint=breakpoint,
                finished=True,
                finish_reason=reason,
                error=result.error,
                logprobs=logprobs,
            )
            try:
                gen.callback(update)
            except Exception as exc:
                error = GenerationError(f"callback raised {type(exc).__name__}: {exc}")
                result = gen.result(FinishReason.ERROR, error)
            except BaseException as exc:  # the engine thread dies of it: settle the caller first
                error = GenerationError(f"callback raised {type(exc).__name__}: {exc}")
                gen.handle._settle(gen.result(FinishReason.ERROR, error), error)
                raise
        gen.handle._settle(result, error)
        gen.callback = None  # the caller's handle keeps ``gen``; drop what it no longer needs
        gen.segments = []


def _observe(observer: BatchObserver, plan: BatchPlan, seconds: float) -> None:
    try:
        observer(len(plan.inputs), sum(p.input.size() for p in plan.inputs), seconds)
    except Exception:  # metrics never fail a batch
        log.exception("batch observer failed")
