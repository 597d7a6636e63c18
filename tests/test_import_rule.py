"""Domain code never imports grpc or the generated protos: only ``*/rpc/`` modules (and ``clients/``) do."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("grpc", "grpc_health", "grpc_reflection", "grpc_tools", "protos", "google.protobuf")


def forbidden_imports(source: str) -> list[str]:
    """Module names imported by ``source`` that domain code must not import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    return found


def domain_modules() -> list[Path]:
    files = []
    for package in ("engine_service", "prefix_service"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT / package)
            if rel.parts[0] != "rpc":
                files.append(path)
    return files


def test_there_is_domain_code_to_check() -> None:
    assert len(domain_modules()) >= 3


@pytest.mark.parametrize("path", domain_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_domain_module_does_not_import_grpc_or_protos(path: Path) -> None:
    assert forbidden_imports(path.read_text()) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import grpc", ["grpc"]),
        ("from grpc import aio", ["grpc"]),
        ("from protos import engine_pb2", ["protos"]),
        ("import protos.engine_pb2 as pb", ["protos.engine_pb2"]),
        ("from google.protobuf import message", ["google.protobuf"]),
        ("import grpcio_like_name", []),
        ("from engine_service.errors import NotFound", []),
        ("from . import rpc", []),
    ],
)
def test_checker_catches_forbidden_imports(source: str, expected: list[str]) -> None:
    """Negative control: the checker flags each forbidden form and nothing else."""
    assert forbidden_imports(source) == expected
