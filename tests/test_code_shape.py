"""The reading load issue 34 set, kept by the figures ``scripts/code_stats.py`` computes: docstrings under
10% of the source's non-blank lines, no Python file over 400 lines, no class over 300, module docstrings
of a few lines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = (
    "protos/engine_pb2_grpc.py",
    "protos/prefix_pb2_grpc.py",
    "protos/engine_pb2.py",
    "protos/prefix_pb2.py",
)


def _code_stats():
    spec = importlib.util.spec_from_file_location("code_stats", ROOT / "scripts" / "code_stats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


code_stats = _code_stats()


def test_the_services_and_clients_read_lightly() -> None:
    stats = code_stats.tree_stats(code_stats.PACKAGES)
    assert stats["docstring_share"] < 0.10
    assert stats["files_over_400"] == {}
    assert stats["classes_over_300"] == {}
    assert stats["module_docstrings_15_plus"] == {}


def test_no_python_file_of_the_repository_passes_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if ".venv" not in p.parts and str(p.relative_to(ROOT)) not in GENERATED
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > code_stats.MAX_FILE_LINES
    }
    assert long == {}


def test_control_the_figures_see_a_docstring_heavy_file_and_a_long_class(tmp_path) -> None:
    doc = '"""' + "\n".join(["a module docstring line"] * 16) + '"""\n'
    body = "class Big:\n" + "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(160))
    path = tmp_path / "heavy.py"
    path.write_text(doc + body)
    stats = code_stats.file_stats(path)
    assert stats["module_docstring_lines"] == 16 and stats["docstring_lines"] == 16
    assert stats["classes"] == [("Big", 321)] and stats["lines"] == 337
