"""Domain code never imports grpc, the generated protos or prometheus_client: only ``*/rpc/`` modules,
the shared gRPC kit ``engine_service/serving/`` (and ``clients/``) do; metrics are read from the domain
(counters, stats) by collectors in ``rpc/``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "grpc_tools",
    "protos",
    "google.protobuf",
    "prometheus_client",
)


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
            if not (rel.parts[0] == "rpc" or (package == "engine_service" and rel.parts[0] == "serving")):
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
        ("from prometheus_client import Counter", ["prometheus_client"]),
        ("import grpcio_like_name", []),
        ("from engine_service.api.errors import NotFound", []),
        ("from . import rpc", []),
    ],
)
def test_checker_catches_forbidden_imports(source: str, expected: list[str]) -> None:
    """Negative control: the checker flags each forbidden form and nothing else."""
    assert forbidden_imports(source) == expected


# --------------------------------------------------------------------------- rooms and their walls


def imported_modules(source: str, package: str) -> list[str]:
    """Absolute module names ``source`` imports (relative imports resolved against ``package``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append(module)
            found += [f"{module}.{alias.name}" for alias in node.names]
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


# (folder, forbidden module prefix): the runtime drives executors and never speaks gRPC; executors
# never reach back into the runtime; model code knows nothing of engines; domain code never imports
# clients.
WALLS = [
    ("engine_service/runtime", "engine_service.rpc"),
    ("engine_service/executors", "engine_service.runtime"),
    ("engine_service/executors", "engine_service.rpc"),
    ("engine_service/model", "engine_service.runtime"),
    ("engine_service/model", "engine_service.executors"),
    ("engine_service/cache", "engine_service.runtime"),
    ("engine_service/cache", "engine_service.executors"),
    ("engine_service", "clients"),
    ("prefix_service", "clients"),
    ("engine_service", "prefix_service"),
]


def crossings(folder: str, forbidden: str) -> list[str]:
    bad = []
    for path in modules_under(folder):
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
        for name in imported_modules(path.read_text(), package):
            if name == forbidden or name.startswith(forbidden + "."):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


@pytest.mark.parametrize(("folder", "forbidden"), WALLS, ids=[f"{f}!->{x}" for f, x in WALLS])
def test_folder_does_not_import_across_its_wall(folder: str, forbidden: str) -> None:
    assert modules_under(folder), f"{folder} holds no modules"
    assert crossings(folder, forbidden) == []


def test_wall_checker_sees_a_crossing() -> None:
    """Negative control: the runtime does import the executors' interface, so a wall there is seen."""
    assert crossings("engine_service/runtime", "engine_service.executors")


def module_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (module-level, function-level and TYPE_CHECKING alike)."""
    known = {module_name(p) for pkg in ("engine_service", "prefix_service") for p in modules_under(pkg)}
    graph: dict[str, set[str]] = {}
    for module in known:
        path = ROOT / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for name in imported_modules(path.read_text(), package):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph.setdefault(module, set()).add(name)
    return graph


def folder_of(module: str) -> str:
    """The folder a module's file lives in (``engine_service.runtime`` for ``...runtime.runner``)."""
    path = ROOT / Path(*module.split("."))
    return module if path.is_dir() else module.rpartition(".")[0]


def circles_across_folders(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other in a circle (strongly connected) and span folders."""

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {m: reach(m) for m in graph}
    groups = {frozenset({m} | {n for n in reached[m] if m in reached.get(n, ())}) for m in graph}
    return sorted(sorted(g) for g in groups if len({folder_of(m) for m in g}) > 1)


def test_no_import_circle_between_folders() -> None:
    assert circles_across_folders(module_graph()) == []


def test_circle_finder_sees_a_circle_across_folders() -> None:
    """Negative control: a circle across two folders is reported, one inside a folder is not."""
    graph = {
        "engine_service.runtime.runner": {"engine_service.executors.base"},
        "engine_service.executors.base": {"engine_service.runtime.runner"},
        "engine_service.runtime.session": {"engine_service.runtime.state"},
        "engine_service.runtime.state": {"engine_service.runtime.session"},
    }
    assert circles_across_folders(graph) == [
        ["engine_service.executors.base", "engine_service.runtime.runner"]
    ]
