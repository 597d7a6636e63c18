"""The engine thread's scheduling: which inputs the next forward runs (decode steps first, prefill chunks
in the remaining room) and whether a generation's input can run at all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.api.errors import InvalidArgument
from engine_service.api.limits import EngineLimits, check_fits, check_nonempty, check_tokens
from engine_service.executors.base import ExecInput, Executor
from engine_service.executors.prepared_input import PreparedInput
from engine_service.runtime.state import ActiveGeneration, Segment, SessionRecord


@dataclass(frozen=True)
class PlannedInput:
    """One generation's slice of the batch. ``breakpoints`` are the config's, for the update."""

    gen: ActiveGeneration
    input: ExecInput
    decode: bool
    breakpoints: tuple[int, ...]


@dataclass(frozen=True)
class BatchPlan:
    """The inputs of one forward, decode steps first."""

    inputs: tuple[PlannedInput, ...]


def plan_batch(
    active: Sequence[ActiveGeneration], max_decode: int, preferred_tokens: int, step: int
) -> BatchPlan:
    """One batch: up to ``max_decode`` decode steps, then prefill chunks in start order up to
    ``preferred_tokens`` positions; advances the prefill cursors and stamps ``last_step``."""
    budget = max(1, preferred_tokens)
    planned: list[PlannedInput] = []
    # least recently stepped first: fair when more are waiting than fit
    decoders = sorted((g for g in active if not g.prefilling), key=lambda g: g.last_step)[:max_decode]
    for gen in decoders:
        rec = gen.record
        assert rec is not None and rec.pending is not None, "a decoding generation has a pending token"
        planned.append(PlannedInput(gen, ExecInput(rec.sid, rec.position, tokens=(rec.pending,)), True, ()))
        gen.last_step = step
        budget -= 1
    prefilled = False
    for gen in active:
        if not gen.prefilling:
            continue
        if budget <= 0 and prefilled:  # the first prefill always runs: long decodes never starve a prompt
            break
        rec = gen.record
        start = rec.position
        room = budget if budget > 0 else gen.config.prefill_chunk  # budget <= 0 only for the first chunk
        n = min(gen.remaining_in_segment(), gen.config.prefill_chunk, room)
        for bp in gen.config.prefill_breakpoints:
            if bp > start:
                n = min(n, bp - start)  # stop exactly at the breakpoint so an observer can clone there
                break
        tokens, prepared, last = gen.take_chunk(n)
        exec_input = ExecInput(rec.sid, start, tokens=tokens, prepared=prepared, want_output=last)
        planned.append(PlannedInput(gen, exec_input, False, gen.config.prefill_breakpoints))
        gen.last_step = step
        budget -= n
        prefilled = True
    return BatchPlan(tuple(planned))


def check_input(
    input: Segment, record: SessionRecord, limits: EngineLimits, executor: Executor
) -> InvalidArgument | None:
    """Why ``input`` cannot run on ``record`` (``api.limits``' rules, the pending token replayed first,
    or a prepared kind the executor refuses), or None."""
    try:
        size = input.size() if isinstance(input, PreparedInput) else len(input)
        check_nonempty(size)
        if isinstance(input, PreparedInput):
            if not _accepts(executor, input):
                raise InvalidArgument(
                    f"prepared input kind {input.kind()!r} is not supported by this executor"
                )
        else:
            check_tokens(input, limits.vocab_size)
        check_fits(record.position + (record.pending is not None), size, limits.max_session_tokens)
    except InvalidArgument as exc:
        return exc
    return None


def _accepts(executor: Executor, input: PreparedInput) -> bool:
    try:
        return bool(executor.accepts(input))
    except Exception:  # ``accepts`` is metadata only: an exception there counts as "no"
        return False
