"""Load OpenBLAS ``RTLD_GLOBAL`` before MLX is imported, so the ``mlx[cpu]`` wheel's ``sgemm`` (netlib,
~2 GFLOP/s) resolves to it (30-80x faster). ``FORKLINE_BLAS=reference`` skips it;
``FORKLINE_OPENBLAS=PATH`` picks the library."""

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
