"""The engine thread's scheduling: which inputs the next forward runs (decode steps first, prefill chunks
in the remaining room) and whether a generation's input can run at all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.api.content import PREPARED
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


# forwards a prompt may wait while shorter ones run before it goes first (a stream of short prompts
# cannot hold a long one back)
STARVED_STEPS = 8


def plan_batch(
    active: Sequence[ActiveGeneration],
    max_decode: int,
    preferred_tokens: int,
    step: int,
    short_tokens: int = 0,
) -> BatchPlan:
    """One batch: up to ``max_decode`` decode steps, then prefill chunks up to ``preferred_tokens``
    positions, shortest remaining prompt first (the least total wait for first tokens) unless one has
    waited ``STARVED_STEPS`` forwards; a forward in which that first prompt ends (a first token
    waits for it) holds at most ``short_tokens`` positions (0: no such cap). Advances the prefill
    cursors and stamps ``last_step``."""
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
    waiting = sorted(
        (g for g in active if g.prefilling),
        key=lambda g: (step - g.last_step <= STARVED_STEPS, g.prefill_left()),
    )
    if waiting and short_tokens and waiting[0].prefill_left() <= short_tokens - len(planned):
        budget = min(budget, short_tokens - len(planned))  # its first token comes after this forward only
    for gen in waiting:
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


def drawn_ids(input: Segment, record: SessionRecord, drawn_tokens: int, grammar: bool) -> tuple[int, ...]:
    """The ids a resumed generation's earlier attempt drew (``GenConfig.drawn_tokens``): the last
    ``drawn_tokens`` of the session's content, its pending token and ``input``. InvalidArgument naming
    ``drawn_tokens`` when there are fewer, or when a ``grammar`` (which consumes them) would read a
    prepared position."""
    if drawn_tokens == 0:
        return ()
    tokens = () if isinstance(input, PreparedInput) else tuple(input)
    pending = () if record.pending is None else (record.pending,)
    if isinstance(input, PreparedInput) or drawn_tokens > len(tokens) + len(pending) + record.position:
        raise InvalidArgument(
            f"drawn_tokens = {drawn_tokens} is more than the session's {record.position} positions"
            f"{' + its pending token' if pending else ''} + the input's {len(tokens)} tokens"
            + (" (prepared input draws nothing)" if isinstance(input, PreparedInput) else "")
        )
    held = drawn_tokens - len(tokens) - len(pending)
    ids = (record.content.values()[-held:] if held > 0 else ()) + pending + tokens
    ids = ids[-drawn_tokens:]
    if grammar and PREPARED in ids:
        raise InvalidArgument("drawn_tokens covers prepared positions, which a json_schema cannot consume")
    return ids


def _accepts(executor: Executor, input: PreparedInput) -> bool:
    try:
        return bool(executor.accepts(input))
    except Exception:  # ``accepts`` is metadata only: an exception there counts as "no"
        return False
