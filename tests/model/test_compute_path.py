"""The compute path is reported, and a slow one is a WARNING that says how to fix it (issue 13 item 6).

The expected strings are written out here from what the machine has (the kernels module's own ISA and
thread count, the BLAS that engine_service loaded), not taken from the code under test.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.blas import BlasStatus, blas_status
from engine_service.executors.module import ModuleExecutor
from engine_service.model import cpu_kernels
from engine_service.model.compute_path import describe_compute_path
from engine_service.model.cpu_kernels import KERNEL_MAX_ROWS_AVX2, KernelStatus
from engine_service.runtime.runner import Runner

ROOT = Path(__file__).resolve().parents[2]
OPENBLAS = BlasStatus("openblas", "/x/libopenblas.so.0", "loaded RTLD_GLOBAL before mlx")
NOT_FOUND = BlasStatus("reference", None, "OpenBLAS not found; install it")
IMPORTED_FIRST = BlasStatus("reference", None, "mlx was imported before engine_service; OpenBLAS not loaded")

try:
    import forkline_kernels
except ImportError:
    forkline_kernels = None
needs_kernels = pytest.mark.skipif(forkline_kernels is None, reason="compiled kernels not built here")


@pytest.fixture
def no_kernels(monkeypatch):
    """The state FORKLINE_KERNELS=off leaves cpu_kernels in, for this test only."""
    monkeypatch.setattr(cpu_kernels, "_status", KernelStatus(False, "none", 0, "FORKLINE_KERNELS=off"))
    monkeypatch.setattr(cpu_kernels, "_module", None)


@needs_kernels
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_this_machine_reports_the_kernel_path(fmt):
    isa, threads = forkline_kernels.isa(), forkline_kernels.num_threads()
    path = describe_compute_path(fmt, on_gpu=False)
    tail = "every row count" if isa == "avx512" else f"panel GEMM above {KERNEL_MAX_ROWS_AVX2} rows"  # AVX2
    assert path.path == f"kernels {fmt} {isa} x{threads} threads, {tail}"
    assert path.slow == (blas_status().name == "reference" or isa != forkline_kernels.best_isa())
    assert (
        describe_compute_path(fmt, on_gpu=False, deterministic=True).path
        == f"kernels {fmt} {isa} x{threads} threads, deterministic"
    )


def test_float32_paths_by_blas():
    fast = describe_compute_path("float32", on_gpu=False, blas=OPENBLAS)
    assert (fast.path, fast.slow, fast.fix) == ("openblas float32", False, "")
    slow = describe_compute_path("float32", on_gpu=False, blas=NOT_FOUND)
    assert (slow.path, slow.slow) == ("reference BLAS float32", True)
    assert "apt-get install libopenblas0-pthread" in slow.fix
    first = describe_compute_path("float32", on_gpu=False, blas=IMPORTED_FIRST)
    assert first.slow and "import engine_service before mlx.core" in first.fix


@needs_kernels
def test_kernels_with_reference_blas_are_slow_for_prefill():
    path = describe_compute_path("q4_1", on_gpu=False, blas=NOT_FOUND)
    # the block matmuls never use BLAS (AVX2's long blocks: the panel GEMM), but float32 heads and
    # MLX's own attention do, so the reference one is slow either way
    avx512 = forkline_kernels.isa() == "avx512"
    assert path.slow and path.path.endswith(
        "every row count" if avx512 else f"panel GEMM above {KERNEL_MAX_ROWS_AVX2} rows"
    )
    assert "libopenblas0-pthread" in path.fix


def test_block_weights_without_kernels_are_the_slow_mlx_ops(no_kernels):
    for fmt in ("q8_0", "q4_1"):
        path = describe_compute_path(fmt, on_gpu=False, blas=OPENBLAS)
        assert path.slow and path.path.startswith(f"mlx quantized ops {fmt} (no compiled kernels")
        assert "scripts/setup.sh" in path.fix
    affine = describe_compute_path("quantized", on_gpu=False, blas=OPENBLAS)
    assert affine.slow and "scripts/setup.sh" in affine.fix and "weights_dtype auto" in affine.fix


def test_gpu_is_never_slow():
    path = describe_compute_path("quantized", on_gpu=True, blas=NOT_FOUND)
    assert not path.slow and path.path.startswith("gpu quantized")


def _runner(tiny_model, weights_dtype):
    model = tiny_model("FRFR", window=4, weights_dtype=weights_dtype)
    return Runner(ModuleExecutor.create(model, max_sessions=2, max_session_tokens=64))


def test_runner_reports_its_path_and_a_fast_one_logs_no_warning(tiny_model, caplog):
    caplog.set_level(logging.WARNING)
    dtype = "q4_1" if forkline_kernels is not None else "float32"
    runner = _runner(tiny_model, dtype)
    try:
        expected = describe_compute_path(dtype)
        assert runner.compute_path == expected.path and runner.slow_path == expected.slow
        if blas_status().name == "openblas" and forkline_kernels is not None:
            assert runner.compute_path.startswith("kernels q4_1 ") and not runner.slow_path
            assert not [r for r in caplog.records if "slow compute path" in r.getMessage()]
    finally:
        runner.shutdown()


def test_runner_on_mlx_ops_warns_how_to_fix(tiny_model, no_kernels, caplog):
    caplog.set_level(logging.WARNING)
    runner = _runner(tiny_model, "q8_0")
    try:
        assert runner.slow_path and runner.compute_path.startswith("mlx quantized ops q8_0")
        warnings = [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and "slow compute path" in r.getMessage()
        ]
        assert len(warnings) == 1
        assert "mlx quantized ops q8_0" in warnings[0].getMessage()
        assert "scripts/setup.sh" in warnings[0].getMessage()
    finally:
        runner.shutdown()


_PROBE = """
import sys
if sys.argv[1] == "mlx-first":
    import mlx.core  # noqa: F401  (before engine_service: MLX binds the reference BLAS)
import engine_service
from engine_service.executors.module import ModuleExecutor
from engine_service.model.random_init import random_model
from engine_service.runtime.runner import Runner
runner = Runner(ModuleExecutor.create(random_model(weights_dtype=sys.argv[2]), max_sessions=1,
                                      max_session_tokens=16))
print("PATH", runner.compute_path, "|", runner.slow_path)
runner.shutdown()
"""


@pytest.mark.parametrize(
    ("case", "dtype", "env", "path", "fix"),
    [
        ("mlx-first", "float32", {}, "reference BLAS float32", "import engine_service before mlx.core"),
        ("plain", "q4_1", {"FORKLINE_KERNELS": "off"}, "mlx quantized ops q4_1", "scripts/setup.sh"),
    ],
)
def test_a_process_on_a_slow_path_says_so(case, dtype, env, path, fix):
    """The two ways to lose the fast path in a real process: importing mlx.core first, and the kernels
    not loading (FORKLINE_KERNELS=off stands for a machine without a compiler)."""
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, case, dtype],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    line = next(t for t in proc.stdout.splitlines() if t.startswith("PATH "))
    assert line.startswith(f"PATH {path}") and line.endswith("| True"), line
    assert "runs on a slow compute path: " + path in proc.stderr, proc.stderr
    assert fix in proc.stderr, proc.stderr
