"""The snapshots one generation takes (its prompt's end: ``prompt_snapshot_due``; each breakpoint; its
last committed token when it ends: ``final_snapshot``), their clones queued on the engine thread before
the next forward; room reserved before it starts (the final one's when it ends: its length is known then).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.api.answers import CloneRefusal
from engine_service.api.errors import ResourceExhausted
from engine_service.api.stream_events import FinishReason, SnapshotKind, prompt_snapshot_due
from engine_service.runtime.clone import CloneFuture
from engine_service.runtime.generation import GenerationUpdate
from engine_service.sessions.handles import HandleRegistry

if TYPE_CHECKING:
    from engine_service.runtime.session import Session


@dataclass(frozen=True)
class PendingSnapshot:
    """A snapshot clone on its way; ``reservation`` None: refused before any clone (``refusal_text``)."""

    future: CloneFuture
    position: int
    kind: SnapshotKind
    reservation: str | None = None
    refusal_text: str = ""


class SnapshotCapture:
    """The snapshots one generation on ``session`` takes for ``owner``, counted against ``payer``."""

    def __init__(
        self,
        registry: HandleRegistry[Session],
        session: Session,
        owner: str,
        *,
        payer: str = "",
        prompt_snapshot: bool,
        breakpoints: tuple[int, ...],
        final_snapshot: bool = False,
        checkpoint_every: int = 0,
    ) -> None:
        self._registry = registry
        self._session = session
        self.owner = owner
        self.payer = payer or owner
        self._prompt_snapshot = prompt_snapshot
        self._breakpoints = frozenset(breakpoints)
        self._final_snapshot = final_snapshot
        self._every = checkpoint_every  # decode checkpoints: a GENERATED clone every N generated tokens
        self._checkpointed = 0  # the last decode checkpoint's position
        self._prompt_end = 0
        self._captured_prompt = False
        self._lock = threading.Lock()
        # (kind, position) -> the handle reserved for that snapshot, or why it has no room
        self._reserved: dict[tuple[SnapshotKind, int], str | ResourceExhausted] = {}

    def reserve(self, prompt_end: int, caller: str) -> None:
        """Reserve every snapshot the generation may take. One for ``caller`` that does not fit
        raises; one handed to another owner is refused QUOTA when due, and the generation goes on."""
        self._prompt_end = prompt_end
        wanted = [(SnapshotKind.BREAKPOINT, p) for p in sorted(self._breakpoints)]
        if self._prompt_snapshot:
            wanted.append((SnapshotKind.PROMPT, prompt_end))
        for kind, position in wanted:
            try:
                reservation: str | ResourceExhausted = self._registry.reserve(
                    self.owner, position, payer=self.payer
                )
            except ResourceExhausted as exc:
                if self.owner == caller:
                    raise
                reservation = exc
            with self._lock:
                self._reserved[(kind, position)] = reservation

    def release(self) -> None:
        with self._lock:
            left, self._reserved = list(self._reserved.values()), {}
        for reservation in left:
            if isinstance(reservation, str):
                self._registry.discard(reservation)

    def due(self, update: GenerationUpdate) -> list[PendingSnapshot]:
        """The snapshots ``update`` calls for, their clones queued (engine thread, never waits)."""
        due: list[PendingSnapshot] = []
        if update.breakpoint is not None and update.breakpoint in self._breakpoints:
            due.append(self._clone(SnapshotKind.BREAKPOINT, update.breakpoint))
        if (
            self._prompt_snapshot
            and not self._captured_prompt
            and prompt_snapshot_due(update.tokens, update.position, self._prompt_end, update.error)
        ):
            self._captured_prompt = True
            due.append(self._clone(SnapshotKind.PROMPT, self._prompt_end))
        checkpoint = self._decode_checkpoint(update)
        if checkpoint is not None:
            due.append(checkpoint)
        return due

    def _decode_checkpoint(self, update: GenerationUpdate) -> PendingSnapshot | None:
        """A clone at the committed position once ``checkpoint_every`` more generated tokens are
        committed since the prompt's end or the last one (never at the end: ``final`` takes that)."""
        if not self._every or update.finished or update.error is not None:
            return None
        last = max(self._checkpointed, self._prompt_end)
        if update.position - last < self._every:
            return None
        self._checkpointed = update.position
        return self._generated(update.position)

    def final(self, update: GenerationUpdate) -> PendingSnapshot | None:
        """The clone at the last committed token of a generation that ended without error (engine thread),
        when that lies past the prompt's end (the pending token is not committed); its room reserved now,
        refused QUOTA when there is none (the generation is over either way)."""
        if (
            not self._final_snapshot
            or not update.finished
            or update.error is not None
            or update.finish_reason == FinishReason.ERROR
            or update.position <= self._prompt_end
        ):
            return None
        return self._generated(update.position)

    def _generated(self, position: int) -> PendingSnapshot:
        """A GENERATED clone at ``position``, its room reserved now (refused QUOTA when there is none)."""
        try:
            reservation = self._registry.reserve(self.owner, position, payer=self.payer)
        except ResourceExhausted as exc:
            refused = CloneFuture.refused(CloneRefusal.QUOTA)
            return PendingSnapshot(refused, position, SnapshotKind.GENERATED, None, str(exc))
        return PendingSnapshot(
            self._session.clone_async(position), position, SnapshotKind.GENERATED, reservation
        )

    def _clone(self, kind: SnapshotKind, position: int) -> PendingSnapshot:
        with self._lock:
            reservation = self._reserved.pop((kind, position), None)
        if isinstance(reservation, ResourceExhausted):
            return PendingSnapshot(
                CloneFuture.refused(CloneRefusal.QUOTA), position, kind, None, str(reservation)
            )
        return PendingSnapshot(self._session.clone_async(position), position, kind, reservation)
