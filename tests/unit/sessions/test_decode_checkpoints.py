"""Decode checkpoints (``capture.checkpoint_every``) over the fake executor: a GENERATED snapshot each
time N more generated tokens are committed, each holding exactly the prompt and the ids streamed up to
its position (content digest), then the final one; none with 0 (the control); a negative value is
refused naming the field before anything is reserved."""

from __future__ import annotations

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.api.errors import InvalidArgument
from engine_service.api.stream_events import SnapshotKind
from engine_service.sessions.engine import GenerationRequest
from tests.unit.sessions.conftest import generated, resident, run, snapshots

PROMPT = [ord(c) for c in "Checkpoints while decoding"]


def test_a_checkpoint_every_n_generated_tokens_then_the_final_one(sessions) -> None:
    events = run(sessions, "alice", PROMPT, max_new_tokens=20, checkpoint_every=6, final_snapshot=True)
    history = PROMPT + generated(events)
    found = [s for s in snapshots(events) if s.kind == SnapshotKind.GENERATED]
    positions = [s.position for s in found]
    # committed positions cross prompt end + 6, + 12, + 18 (one token per step); the final one last
    assert positions == [len(PROMPT) + 6, len(PROMPT) + 12, len(PROMPT) + 18, len(PROMPT) + 19]
    for snap in found:
        assert snap.handle is not None and snap.content_digest == content_digest(history[: snap.position])
    control = run(sessions, "alice", PROMPT, max_new_tokens=20, final_snapshot=True)
    assert [s.position for s in snapshots(control)] == [len(PROMPT) + 19]


def test_a_negative_interval_is_refused_before_anything_is_reserved(sessions) -> None:
    before = resident(sessions)
    request = GenerationRequest(PROMPT, GenConfig(max_new_tokens=4), checkpoint_every=-1)
    with pytest.raises(InvalidArgument, match="capture.checkpoint_every"):
        sessions.generate("alice", request)
    assert resident(sessions) == before
