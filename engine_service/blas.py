"""Load a fast BLAS into the global symbol scope before MLX is imported.

The Linux ``mlx[cpu]`` wheel links the reference (netlib) BLAS: a float32 matmul runs at about
2 GFLOP/s. When OpenBLAS (Debian ``libopenblas0-pthread``) is loaded with ``RTLD_GLOBAL`` before
``mlx.core`` is first imported, MLX's ``sgemm`` calls resolve to it and run 30-80x faster.

``engine_service/__init__.py`` calls :func:`load_openblas` so that importing any engine module
does this first. Set ``FORKLINE_BLAS=reference`` to skip it (benchmarks compare both), or
``FORKLINE_OPENBLAS=/path/libopenblas.so.0`` to point at a specific library.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasStatus:
    """Which BLAS MLX's CPU backend uses in this process."""

    name: str  # "openblas" | "reference" | "accelerate"
    path: str | None
    reason: str


_status: BlasStatus | None = None


def load_openblas() -> BlasStatus:
    """Load OpenBLAS RTLD_GLOBAL once, if present and MLX is not yet imported. Idempotent."""
    global _status
    if _status is not None:
        return _status
    if sys.platform == "darwin":
        _status = BlasStatus("accelerate", None, "macOS: MLX uses Accelerate / Metal")
        return _status
    if os.environ.get("FORKLINE_BLAS", "").lower() == "reference":
        _status = BlasStatus("reference", None, "FORKLINE_BLAS=reference")
        return _status
    if "mlx.core" in sys.modules:
        _status = BlasStatus("reference", None, "mlx was imported before engine_service; OpenBLAS not loaded")
        return _status
    override = os.environ.get("FORKLINE_OPENBLAS")
    for path in (override,) if override else _CANDIDATES:
        if path and os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:  # a broken library: fall back, say why
                _status = BlasStatus("reference", None, f"loading {path} failed: {exc}")
                return _status
            _status = BlasStatus("openblas", path, "loaded RTLD_GLOBAL before mlx")
            return _status
    _status = BlasStatus(
        "reference",
        None,
        "OpenBLAS not found; install it with `apt-get install libopenblas0-pthread` (30-80x faster fp32 matmul)",
    )
    return _status


def blas_status() -> BlasStatus:
    """The BLAS chosen at import time (loads it if nobody did yet)."""
    return load_openblas()
