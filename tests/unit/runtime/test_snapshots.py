"""The runner's export and import commands around the executor: refusals with their reasons, futures
settled at shutdown (fake executor: it supports neither)."""

from __future__ import annotations

import mlx.core as mx

from engine_service.api.config import GenConfig
from engine_service.api.snapshot_files import LoadRefusal, SaveRefusal, StateLayout
from engine_service.cache.seq_state import SeqState
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.runtime.snapshots import ImportFuture
from tests.unit.runtime.conftest import engine_paused

LAYOUT = StateLayout("batched-sequence", "layers=full;max_write=4;kv_heads=1;head_dim=2;dtype=float32")


def snapshot(fingerprint: str = "FakeExecutor") -> SessionSnapshot:
    arrays = {"layers.0.keys": mx.zeros((1, 3, 2)), "layers.0.values": mx.zeros((1, 3, 2))}
    return SessionSnapshot(fingerprint, LAYOUT, SeqState(3, 3, arrays), (1, 2, 3))


def test_an_executor_without_snapshots_refuses_both_ways(runner) -> None:
    s = runner.open_session()
    s.generate_async([1, 2, 3], GenConfig(max_new_tokens=2)).wait(10)
    future = s.export_async()
    assert future.result(10) is None and future.refusal == SaveRefusal.UNSUPPORTED
    imported = runner.import_async(snapshot())
    assert imported.result(10) is None and imported.refusal == LoadRefusal.UNSUPPORTED and imported.detail
    runner.flush(10)
    assert runner.resident_sessions == 1 and s.valid


def test_closed_session_refuses_at_once(runner) -> None:
    s = runner.open_session()
    s.close()
    future = s.export_async()
    assert future.done() and future.result() is None and future.refusal == SaveRefusal.SOURCE_UNUSABLE


def test_queued_commands_are_settled_as_stopping_at_shutdown(runner, fake) -> None:
    s = runner.open_session()
    with engine_paused(runner, fake):
        export = s.export_async()
        imported = runner.import_async(snapshot())
        runner.shutdown(0)  # the engine stops with both still queued
    runner.shutdown(10)
    assert export.result(10) is None and export.refusal == SaveRefusal.STOPPING
    assert imported.result(10) is None and imported.refusal == LoadRefusal.STOPPING
    late = runner.import_async(snapshot())
    assert late.done() and late.refusal == LoadRefusal.STOPPING


def test_refused_future_carries_reason_and_detail() -> None:
    future = ImportFuture.refused(LoadRefusal.NO_ROOM, "no slot")
    assert future.result() is None and future.refusal == LoadRefusal.NO_ROOM and future.detail == "no slot"
