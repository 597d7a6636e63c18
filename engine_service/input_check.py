"""Checks a generation's input against the executor before anything is scheduled (engine thread)."""

from __future__ import annotations

from engine_service.errors import InvalidArgument
from engine_service.executor import Executor, ExecutorLimits
from engine_service.prepared_input import PreparedInput
from engine_service.session_record import Segment, SessionRecord


def check_input(input: Segment, record: SessionRecord, limits: ExecutorLimits,
                executor: Executor) -> InvalidArgument | None:
    """The reason ``input`` cannot run on ``record``, or None.

    Rejects an empty input, token ids outside ``[0, vocab_size)``, a prepared input the executor does
    not accept (``executor.accepts`` is metadata only; an exception there counts as "no"), and an
    input that would not fit in ``max_session_tokens`` together with the committed positions and the
    pending token replayed first.
    """
    if isinstance(input, PreparedInput):
        size = input.size()
        if size < 1:
            return InvalidArgument("input is empty")
        try:
            accepted = bool(executor.accepts(input))
        except Exception:
            accepted = False
        if not accepted:
            return InvalidArgument(f"prepared input kind {input.kind()!r} is not supported by this executor")
    else:
        size = len(input)
        if size == 0:
            return InvalidArgument("input is empty")
        vocab = limits.vocab_size
        for i, tok in enumerate(input):
            if not 0 <= tok < vocab:
                return InvalidArgument(f"token id {tok} at index {i} is outside the vocabulary [0, {vocab})")
    needed = record.position + (record.pending is not None) + size
    if needed > limits.max_session_tokens:
        return InvalidArgument(
            f"input of {size} positions does not fit: session at {record.position}"
            f"{' + 1 pending' if record.pending is not None else ''}, max_session_tokens={limits.max_session_tokens}")
    return None
