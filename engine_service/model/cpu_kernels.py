"""The compiled CPU kernels (``forkline_kernels``, built by ``scripts/setup.sh``), loaded once; without
them :func:`kernel_status` says why, and the engine keeps float32 weights or runs the block formats
through MLX's ops (correct, 3-10x slower)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType

log = logging.getLogger(__name__)

BUILD_HINT = "run scripts/setup.sh (needs a C++ compiler), or: pip install --no-build-isolation ./kernels"


@dataclass(frozen=True)
class KernelStatus:
    """Whether the compiled kernels load here, with which instruction set and worker threads."""

    available: bool
    isa: str  # "avx2" | "scalar" | "none"
    threads: int
    reason: str

    def describe(self) -> str:
        if self.available:
            return f"compiled kernels ({self.isa}, {self.threads} threads)"
        return f"no compiled kernels ({self.reason})"


_module: ModuleType | None = None
_status: KernelStatus | None = None


def _load() -> KernelStatus:
    global _module
    if os.environ.get("FORKLINE_KERNELS", "").lower() == "off":
        return KernelStatus(False, "none", 0, "FORKLINE_KERNELS=off")
    try:
        import forkline_kernels
    except ImportError as exc:
        return KernelStatus(False, "none", 0, f"{exc}; {BUILD_HINT}")
    _module = forkline_kernels
    return KernelStatus(True, forkline_kernels.isa(), forkline_kernels.num_threads(), "loaded")


def kernel_status() -> KernelStatus:
    """Load the kernels on first call (idempotent) and report."""
    global _status
    if _status is None:
        _status = _load()
    return _status


def kernels() -> ModuleType | None:
    """The ``forkline_kernels`` module, or None when it does not load."""
    kernel_status()
    return _module


# rows up to which block-quantized weights go through the kernels when their ISA is AVX2 (above, BLAS)
KERNEL_MAX_ROWS_AVX2 = 64


def kernel_max_rows() -> float:
    """Rows up to which block weights take the kernels on the CPU (longer blocks: BLAS float32): every
    row count with AVX-512, ``KERNEL_MAX_ROWS_AVX2`` with AVX2. Read per call (``set_isa``). Measurements:
    docs/MODELS.md (CPU kernels)."""
    ext = kernels()
    return float("inf") if ext is not None and ext.isa() == "avx512" else KERNEL_MAX_ROWS_AVX2
