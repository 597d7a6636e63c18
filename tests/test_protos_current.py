"""The committed generated code matches what ``python -m protos.regen`` produces from the .proto files."""

from __future__ import annotations

from pathlib import Path

from protos import regen


def test_generated_code_is_current(tmp_path: Path) -> None:
    written = regen.regenerate(tmp_path)
    assert sorted(p.name for p in written) == sorted(regen.generated_names())
    stale = [
        p.name for p in written if p.read_text() != (regen.PROTO_DIR / p.name).read_text(encoding="utf-8")
    ]
    assert not stale, f"regenerate with `python -m protos.regen`: {stale} differ from the .proto files"


def test_imports_are_package_relative(tmp_path: Path) -> None:
    regen.regenerate(tmp_path)
    text = (tmp_path / "prefix_pb2.py").read_text()
    assert "from protos import engine_pb2" in text
    assert "\nimport engine_pb2" not in text


def test_check_detects_a_change(tmp_path: Path) -> None:
    """Negative control: a generated file that differs from its proto is caught by the comparison."""
    regen.regenerate(tmp_path)
    committed = (regen.PROTO_DIR / "engine_pb2.py").read_text()
    assert (tmp_path / "engine_pb2.py").read_text() == committed
    assert committed.replace("forkline.engine.v1", "forkline.engine.v2") != committed
