"""cpu_quota over fake cgroup folders: the quota in CPUs from cgroup v2 ``cpu.max`` and v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, rounded up and capped by the affinity; no quota (``max``,
-1, nothing readable) gives the affinity; apply_cpu_quota sets the kernel pool's variable and resizes an
imported kernel module unless the operator set it, and leaves set variables alone."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_service import cpu_quota
from engine_service.cpu_quota import (
    KERNEL_THREADS_ENV,
    OPENBLAS_THREADS_ENV,
    apply_cpu_quota,
    cgroup_quota,
    cpu_budget,
)


def v2(tmp_path: Path, text: str) -> Path:
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def v1(tmp_path: Path, quota: int, period: int, folder: str = "cpu,cpuacct") -> Path:
    d = tmp_path / folder
    d.mkdir()
    (d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (d / "cpu.cfs_period_us").write_text(f"{period}\n")
    return tmp_path


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("400000 100000\n", 4.0),
        ("50000 100000", 0.5),
        ("150000 100000", 1.5),
        ("max 100000\n", None),
        ("200000", 2.0),
    ],
)
def test_cgroup_v2_quota(tmp_path, text, cpus) -> None:
    assert cgroup_quota(v2(tmp_path, text)) == cpus


def test_cgroup_v1_quota(tmp_path) -> None:
    assert cgroup_quota(v1(tmp_path, 300000, 100000)) == 3.0
    other = tmp_path / "other"
    other.mkdir()
    assert cgroup_quota(v1(other, -1, 100000, folder="cpu")) is None  # -1: unlimited


def test_nothing_readable_is_no_quota(tmp_path) -> None:
    assert cgroup_quota(tmp_path) is None
    assert cgroup_quota(v2(tmp_path, "garbage here")) is None


@pytest.mark.parametrize(
    ("text", "affinity", "cpus"), [("150000 100000", 8, 2), ("50000 100000", 8, 1), ("1600000 100000", 4, 4)]
)
def test_budget_rounds_the_quota_up_and_caps_it_by_the_affinity(
    tmp_path, monkeypatch, text, affinity, cpus
) -> None:
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: affinity)
    budget = cpu_budget(v2(tmp_path, text))
    assert budget.cpus == cpus and "cgroup CPU quota" in budget.source


def test_no_quota_gives_the_affinity(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: 6)
    assert cpu_budget(v2(tmp_path, "max 100000")).cpus == 6


def test_apply_sets_the_kernel_threads_and_resizes_an_imported_module(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: 16)
    monkeypatch.delenv(KERNEL_THREADS_ENV, raising=False)
    monkeypatch.setenv(OPENBLAS_THREADS_ENV, "1")  # set by the operator: OpenBLAS is left alone
    resized: list[int] = []
    monkeypatch.setitem(sys.modules, "forkline_kernels", SimpleNamespace(set_num_threads=resized.append))
    blas: list[int] = []
    monkeypatch.setattr(cpu_quota, "_openblas_threads", blas.append)
    assert apply_cpu_quota(v2(tmp_path, "400000 100000")).cpus == 4

    assert os.environ[KERNEL_THREADS_ENV] == "4" and resized == [4] and blas == []


def test_apply_leaves_variables_the_operator_set(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: 16)
    monkeypatch.setenv(KERNEL_THREADS_ENV, "3")
    monkeypatch.delenv(OPENBLAS_THREADS_ENV, raising=False)
    resized: list[int] = []
    monkeypatch.setitem(sys.modules, "forkline_kernels", SimpleNamespace(set_num_threads=resized.append))
    blas: list[int] = []
    monkeypatch.setattr(cpu_quota, "_openblas_threads", blas.append)
    apply_cpu_quota(v2(tmp_path, "200000 100000"))

    assert os.environ[KERNEL_THREADS_ENV] == "3" and resized == [] and blas == [2]
