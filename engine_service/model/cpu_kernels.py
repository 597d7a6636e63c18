"""The compiled CPU kernels (``forkline_kernels``, built from ``kernels/`` by ``scripts/setup.sh``).

Loaded once; when they are missing or built against another mlx, :func:`kernel_status` says why and the
engine keeps float32 weights on the CPU (``weights_dtype=auto``) or runs ``q8_0`` / ``q4_1`` through
MLX's own ops (correct, 3-10x slower than float32: only for machines that cannot compile).
"""

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
