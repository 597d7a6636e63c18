"""Resources from measurement: the engine's memory limit is docs/DEPLOY.md's formula over
deploy/sizing.json (idle RSS + --max_sessions x --max_session_tokens x the measured bytes per position,
x headroom, rounded up to 256 MiB: tests/deploy/sizing.py), requests equal limits for memory (an engine
is not evicted under node pressure for a cache it was promised), the kernel and OpenBLAS threads come
from the CPU limit (no thread-count variable overrides the cgroup quota), and docs/DEPLOY.md quotes the
measurements the manifests are sized from. Negative controls: the issue's 4 Gi at 32 x 2,048 with the
old float32 figure, a limit off the formula, and a thread variable are caught."""

from __future__ import annotations

import copy
import json
import re

import pytest

from engine_service.cpu_quota import KERNEL_THREADS_ENV, OPENBLAS_THREADS_ENV
from tests.deploy.manifests import load, quantity, workload
from tests.deploy.sizing import ROOT, Sizing

DEPLOY_MD = ROOT / "docs" / "DEPLOY.md"
SIZING = Sizing.load()


def engine(docs: list[dict]) -> tuple[dict, object]:
    return workload(docs, "forkline-engine")[1:]


def resource_problems(docs: list[dict], sizing: Sizing) -> list[str]:
    c, args = engine(docs)
    problems = []
    want = sizing.engine_memory_bytes(args.max_sessions, args.max_session_tokens)
    limit = quantity(c["resources"]["limits"]["memory"])
    if limit != want:
        problems.append(
            f"engine memory limit {limit / 2**30:.2f} GiB, the formula gives {want / 2**30:.2f} GiB"
        )
    if quantity(c["resources"]["requests"]["memory"]) != limit:
        problems.append("engine memory request differs from its limit")
    env = {e["name"] for e in c.get("env", [])}
    for var in (KERNEL_THREADS_ENV, OPENBLAS_THREADS_ENV):
        if var in env:
            problems.append(f"engine sets {var}: the threads must follow the CPU limit (cgroup quota)")
    if quantity(c["resources"]["limits"]["cpu"]) % 1:
        problems.append("engine CPU limit is fractional: a whole number of kernel threads")
    return problems


@pytest.mark.parametrize("build", ["base", "overlays/auth"])
def test_the_engine_limits_match_the_measured_formula(build) -> None:
    assert resource_problems(load(build).docs, SIZING) == []


def test_control_the_old_float32_figure_does_not_fit_the_manifests() -> None:
    docs = load("base").docs
    old = Sizing({**SIZING.measured, "bytes_per_position": 66_500, "idle_rss_bytes": 335e6}, SIZING.stated)
    assert any("the formula gives" in p for p in resource_problems(docs, old))  # the 66.5 KB


@pytest.mark.parametrize(
    "change,says",
    [
        (lambda c: c["resources"]["limits"].update(memory="4Gi"), "the formula gives"),
        (lambda c: c["resources"]["requests"].update(memory="1Gi"), "request differs"),
        (lambda c: c.setdefault("env", []).append({"name": "OPENBLAS_NUM_THREADS", "value": "4"}), "cgroup"),
    ],
)
def test_control_a_limit_off_the_formula_is_caught(change, says) -> None:
    docs = copy.deepcopy(load("base").docs)
    change(engine(docs)[0])
    assert any(says in p for p in resource_problems(docs, SIZING))


def test_deploy_md_quotes_the_measurements() -> None:
    text = DEPLOY_MD.read_text(encoding="utf-8").replace(",", "")
    data = json.loads((ROOT / "deploy" / "sizing.json").read_text(encoding="utf-8"))
    for section in ("measured", "stated"):
        for key, value in data[section].items():
            if not isinstance(value, (int, float)):
                continue
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            assert re.search(rf"(?<![\d.]){re.escape(shown)}(?![\d])", text), (
                f"DEPLOY.md does not quote {key} = {shown}"
            )
