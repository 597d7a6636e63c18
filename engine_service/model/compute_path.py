"""Which compute path a model runs on here, as one line, and whether it is a slow one (the reference
BLAS, quantized weights on MLX's CPU ops), with the fix. Spec: docs/MODELS.md (CPU kernels)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from engine_service.blas import BlasStatus, blas_status
from engine_service.model.cpu_kernels import (
    BUILD_HINT,
    KERNEL_MAX_ROWS_AVX2,
    kernel_max_rows,
    kernel_status,
    kernels,
)
from engine_service.model.formats.block_quant import is_block_dtype
from engine_service.model.formats.weights import gpu_available

OPENBLAS_HINT = (
    "install OpenBLAS (`apt-get install libopenblas0-pthread`, or FORKLINE_OPENBLAS=/path/libopenblas.so.0) "
    "and import engine_service before mlx.core"
)


@dataclass(frozen=True)
class ComputePath:
    """``path`` (e.g. ``kernels q4_1 avx2 x2 threads, ...``), ``slow``, and ``fix`` ("" unless slow)."""

    path: str
    slow: bool
    fix: str = ""

    def __str__(self) -> str:
        return self.path


def _blas_fix(status: BlasStatus) -> str:
    if status.reason == "FORKLINE_BLAS=reference":
        return "unset FORKLINE_BLAS (it selects the reference BLAS)"
    if "imported before" in status.reason:
        return "import engine_service before mlx.core (it loads OpenBLAS first)"
    return OPENBLAS_HINT


def describe_compute_path(
    weights_dtype: str,
    *,
    deterministic: bool = False,
    on_gpu: bool | None = None,
    blas: BlasStatus | None = None,
) -> ComputePath:
    """The path a model with ``weights_dtype`` (resolved, as the loader reports it) runs on here."""
    if on_gpu if on_gpu is not None else gpu_available():
        return ComputePath(f"gpu {weights_dtype} (mlx ops)", False)
    blas = blas or blas_status()
    blas_name = "reference BLAS" if blas.name == "reference" else blas.name
    reference = blas.name == "reference"
    if is_block_dtype(weights_dtype):
        ext = kernels()
        if ext is None:
            return ComputePath(
                f"mlx quantized ops {weights_dtype} (no compiled kernels: {kernel_status().reason})",
                True,
                f"build the kernels: {BUILD_HINT}",
            )
        isa, best = ext.isa(), ext.best_isa()
        path = f"kernels {weights_dtype} {isa} x{ext.num_threads()} threads"
        if deterministic:
            path += ", deterministic"
        elif math.isinf(kernel_max_rows()):
            path += ", every row count"
        else:
            path += f", panel GEMM above {KERNEL_MAX_ROWS_AVX2} rows"
        if isa != best:
            return ComputePath(path, True, f"this CPU supports {best}: unset FORKLINE_KERNEL_ISA")
        if reference:  # matmuls off the kernels' path (float32 heads, MLX's attention)
            return ComputePath(path, True, _blas_fix(blas))
        return ComputePath(path, False)
    if weights_dtype == "quantized":
        fix = "use weights_dtype auto (q8_0 / q4_1 through the compiled kernels)"
        if kernels() is None:
            fix += f"; build the kernels: {BUILD_HINT}"
        return ComputePath("mlx quantized ops (4-bit affine)", True, fix)
    if weights_dtype in ("float16", "bfloat16"):
        return ComputePath(
            f"mlx {weights_dtype} matmul",
            True,
            "use weights_dtype auto or float32 (MLX's CPU half-precision matmul is slow)",
        )
    path = f"{blas_name} {weights_dtype}"
    if reference:
        return ComputePath(path, True, _blas_fix(blas))
    return ComputePath(path, False)


def warn_if_slow(path: ComputePath, logger: logging.Logger, what: str = "engine") -> None:
    """A WARNING naming the slow path and its fix (nothing for a fast one)."""
    if path.slow:
        logger.warning("%s runs on a slow compute path: %s; to fix: %s", what, path.path, path.fix)
