"""The executor's resident sessions: executor-local ids -> cache sequence, sampler and token history;
clones, exports, pins and imports through the cache."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from engine_service.api.errors import NotFound
from engine_service.cache.batch_control import BatchControl
from engine_service.cache.pinned_state import PinnableCache, PinnedState
from engine_service.cache.seq_state import SeqState, StateTransfer
from engine_service.executors.plan import SessionState

log = logging.getLogger(__name__)


class SessionTable:
    """At most ``max_sessions`` sessions (active, retained, in-flight clones), each over one sequence."""

    def __init__(self, cache: BatchControl, max_sessions: int) -> None:
        self._cache = cache
        self.max_sessions = max_sessions
        self._states: dict[int, SessionState] = {}
        self._next_sid = 1

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, sid: object) -> bool:
        return sid in self._states

    def __iter__(self) -> Iterator[int]:
        return iter(self._states)

    def get(self, sid: int) -> SessionState | None:
        return self._states.get(sid)

    def state(self, sid: int) -> SessionState:
        """``sid``'s state; NotFound for an unknown id."""
        state = self._states.get(sid)
        if state is None:
            raise NotFound(f"unknown session {sid}")
        return state

    def full(self) -> bool:
        return len(self._states) >= self.max_sessions

    def open(self) -> int | None:
        if self.full():
            return None
        seq = self._cache.seq_new()
        return None if seq is None else self.adopt(seq)

    def adopt(self, seq: int, history: Sequence[int] = ()) -> int:
        """A new id for a sequence the cache just made (its positions hold ``history``)."""
        sid = self._next_sid
        self._next_sid += 1
        self._states[sid] = SessionState(seq, history=list(history))
        return sid

    def close(self, sid: int) -> None:
        state = self._states.pop(sid, None)
        if state is not None:
            self._cache.seq_rm(state.seq)

    def clone(self, sid: int, upto: int) -> int | None:
        """Clone via the cache, then re-check the position the backend reports; undo a mismatch."""
        state = self._states.get(sid)
        if state is None or upto < 0 or self.full():
            return None
        cache, child = self._cache, None
        try:
            child = cache.seq_clone(state.seq, upto)
            if child is None:
                return None
            got = cache.pos(child)
            if got != upto:
                log.warning("clone(%d, %d): backend reports position %d; undoing", sid, upto, got)
                cache.seq_rm(child)
                return None
        except Exception:  # the contract: any failure inside clone is a refusal, the engine keeps running
            log.exception("clone(%d, %d) failed; refusing", sid, upto)
            if child is not None:
                try:
                    cache.seq_rm(child)
                except Exception:
                    log.exception("releasing the failed clone's sequence %d failed", child)
            return None
        return self.adopt(child, state.history[:upto])

    def export(self, sid: int, upto: int) -> SeqState | None:
        state = self._states.get(sid)
        if state is None or upto < 0 or not isinstance(self._cache, StateTransfer):
            return None
        return self._cache.export_seq(state.seq, upto)

    def pin(self, sid: int) -> PinnedState | None:
        state = self._states.get(sid)
        if state is None or not isinstance(self._cache, PinnableCache):
            return None
        return self._cache.pin_seq(state.seq)

    def import_state(self, state: SeqState, history: Sequence[int]) -> int | None:
        """A new session holding ``state`` (whose positions hold ``history``), or None (no slot or room)."""
        if self.full() or len(history) != state.length:
            return None
        seq = self._cache.import_seq(state)
        return None if seq is None else self.adopt(seq, history)
