"""Source rules of issue 34: identity and deadlines travel as a value (no context variables in either
service), and nothing outside the gateway reaches through it to its cache or engine backend. Each scan
is shown to find a planted violation (negative controls)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_VARIABLES = re.compile(r"\bcontextvars\b|\bContextVar\b")
REACHING_THROUGH = re.compile(r"\.gateway\.(cache|backend)\b")


def violations(folders: list[Path], pattern: re.Pattern[str]) -> list[str]:
    """``path:line`` of every line under ``folders`` (Python files) that ``pattern`` matches."""
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(folder.parent)}:{number}")
    return found


def test_no_context_variables_in_either_service() -> None:
    folders = [ROOT / "engine_service", ROOT / "prefix_service"]
    assert all(folder.is_dir() for folder in folders)
    assert violations(folders, CONTEXT_VARIABLES) == []


def test_nothing_reaches_through_the_gateway() -> None:
    folders = [ROOT / "prefix_service", ROOT / "bench"]
    assert violations(folders, REACHING_THROUGH) == []


@pytest.mark.parametrize(
    ("pattern", "source"),
    [
        (CONTEXT_VARIABLES, "import contextvars\n"),
        (CONTEXT_VARIABLES, "from contextvars import ContextVar\n"),
        (REACHING_THROUGH, "n = len(member.gateway.cache)\n"),
        (REACHING_THROUGH, "b = m.gateway.backend.instance_id\n"),
    ],
)
def test_the_scans_find_a_planted_violation(tmp_path: Path, pattern: re.Pattern[str], source: str) -> None:
    folder = tmp_path / "prefix_service"
    folder.mkdir()
    (folder / "clean.py").write_text("gateway = fleet.sole()\nlen(gateway)\n")
    (folder / "planted.py").write_text(source)
    assert violations([folder], pattern) == ["prefix_service/planted.py:1"]
