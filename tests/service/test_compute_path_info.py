"""Info reports the engine's compute path and whether it is a slow one (issue 13 item 6)."""

from __future__ import annotations

from clients.engine_client import EngineClient
from engine_service.blas import blas_status
from engine_service.executors.options import ExecutorSettings
from engine_service.model import cpu_kernels
from engine_service.model.cpu_kernels import KernelStatus
from engine_service.model.random_init import random_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from tests.service.conftest import char_tokenizer


def test_info_reports_the_float32_path(engine) -> None:
    info = EngineClient(engine.address, owner="alice").info()
    assert info.compute_path == engine.runner.compute_path
    blas = "reference BLAS" if blas_status().name == "reference" else blas_status().name
    assert info.compute_path == f"{blas} float32"
    assert info.slow_path == (blas_status().name == "reference")


def test_info_reports_a_slow_path(monkeypatch) -> None:
    """q8_0 weights without the compiled kernels run on MLX's own ops: Info says slow."""
    monkeypatch.setattr(cpu_kernels, "_status", KernelStatus(False, "none", 0, "FORKLINE_KERNELS=off"))
    monkeypatch.setattr(cpu_kernels, "_module", None)
    deps = EngineSessions.build(
        random_model("FRFR", 4, 0, weights_dtype="q8_0"),
        char_tokenizer(),
        model_name="tiny-q8_0",
        chat=ChatFormatter(name="chatml"),
        executor=ExecutorSettings(max_sessions=2, max_session_tokens=64, prefill_chunk=64),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    try:
        info = EngineClient(f"127.0.0.1:{port}", owner="alice").info()
        assert info.slow_path and info.compute_path.startswith("mlx quantized ops q8_0 (no compiled kernels")
    finally:
        server.stop(0, shutdown_runner=True)
