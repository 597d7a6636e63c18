"""How many CPUs this process may use: the cgroup CFS quota (a container sees its node's CPUs in
``os.cpu_count()``), else its affinity; the engine sizes the kernel pool and OpenBLAS to it at start."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
KERNEL_THREADS_ENV = "FORKLINE_KERNEL_THREADS"
OPENBLAS_THREADS_ENV = "OPENBLAS_NUM_THREADS"


@dataclass(frozen=True)
class CpuBudget:
    """``cpus``: the CPUs to size thread pools to; ``source``: where the number came from."""

    cpus: int
    source: str


def cgroup_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CFS quota in CPUs (e.g. 4.0, 0.5), None when unlimited or unreadable."""
    try:
        fields = (root / "cpu.max").read_text().split()  # "max 100000" or "400000 100000" (cgroup v2)
    except OSError:
        fields = []
    if fields:
        try:
            return (
                None if fields[0] == "max" else int(fields[0]) / int(fields[1] if len(fields) > 1 else 100000)
            )
        except ValueError:
            return None
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_budget(root: Path = CGROUP_ROOT) -> CpuBudget:
    """``ceil(quota / period)`` CPUs, at most the affinity's (cgroup v2 ``cpu.max``, or v1)."""
    cpus = affinity_cpus()
    quota = cgroup_quota(root)
    if quota is None:
        return CpuBudget(cpus, f"{cpus} CPUs of the affinity mask (no cgroup CPU quota)")
    limited = max(1, min(cpus, math.ceil(quota - 1e-9)))
    return CpuBudget(limited, f"cgroup CPU quota {quota:g} CPUs (affinity {cpus})")


def apply_cpu_quota(root: Path = CGROUP_ROOT) -> CpuBudget:
    """Size the kernel pool and OpenBLAS to :func:`cpu_budget` unless their variables are set; returns
    the budget and logs the threads each got."""
    budget = cpu_budget(root)
    kernels = os.environ.get(KERNEL_THREADS_ENV)
    if kernels is None:
        os.environ[KERNEL_THREADS_ENV] = str(budget.cpus)
        module = sys.modules.get("forkline_kernels")
        if module is not None:  # already imported: its pool may exist; resize it (no kernel ran yet)
            module.set_num_threads(budget.cpus)
    openblas = os.environ.get(OPENBLAS_THREADS_ENV)
    if openblas is None:
        _openblas_threads(budget.cpus)
    log.info(
        "CPU budget: %s -> kernel threads %s, OpenBLAS threads %s",
        budget.source,
        kernels if kernels is not None else f"{budget.cpus}",
        openblas if openblas is not None else f"{budget.cpus}",
    )
    return budget


def _openblas_threads(n: int) -> None:
    from engine_service.blas import blas_status

    status = blas_status()
    if status.name != "openblas" or not status.path:
        return
    try:
        ctypes.CDLL(status.path, mode=ctypes.RTLD_GLOBAL).openblas_set_num_threads(ctypes.c_int(n))
    except (OSError, AttributeError):
        log.debug("could not set OpenBLAS threads", exc_info=True)
