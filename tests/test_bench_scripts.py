"""The benchmarks are not run by the tests (too slow), but they must keep importing against the code
they measure: a refactor that breaks one fails here instead of at the next benchmark run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))


def test_every_benchmark_is_listed() -> None:
    assert {p.stem for p in SCRIPTS} >= {
        "bench_model",
        "bench_cache",
        "bench_runner",
        "bench_prefix",
        "bench_services",
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_benchmark_imports_and_has_main(script: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs the imports, not the benchmark (guarded by __main__)
    assert callable(getattr(module, "main", None))
