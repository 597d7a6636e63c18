"""The AST walk behind the import rules: the modules a source imports, the crossings of a wall or a
door, the module graph and its circles (of files and of rooms). ``ROOT`` is the tree it reads."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_rules import FORBIDDEN, GRPC_FOLDERS

ROOT = Path(__file__).resolve().parents[1]


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
    for package, grpc_folders in GRPC_FOLDERS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT / package).parts[0] not in grpc_folders:
                files.append(path)
    return files


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


def crossings(folder: str, forbidden: str) -> list[str]:
    bad = []
    for path in modules_under(folder):
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
        for name in imported_modules(path.read_text(), package):
            if name == forbidden or name.startswith(forbidden + "."):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def engine_imports_outside(source: str, package: str, allowed: tuple[str, ...]) -> list[str]:
    """The engine_service modules ``source`` imports that are not under an ``allowed`` prefix."""
    return [
        name
        for name in imported_modules(source, package)
        if (name == "engine_service" or name.startswith("engine_service."))
        and not any(name == a or name.startswith(a + ".") for a in allowed)
    ]


def door_crossings(folder: str, allowed: tuple[str, ...]) -> list[str]:
    bad = []
    for path in modules_under(folder):
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
        bad += [
            f"{path.relative_to(ROOT)} imports {n}"
            for n in engine_imports_outside(path.read_text(), package, allowed)
        ]
    return bad


def rpc_importers() -> list[str]:
    """Modules of the services, outside the engine's rpc/ and its __main__, that import engine_service.rpc."""
    bad = []
    for package in ("engine_service", "prefix_service"):
        for path in modules_under(package):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("engine_service", "rpc") or rel == Path("engine_service/__main__.py"):
                continue
            pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
            names = imported_modules(path.read_text(), pkg)
            bad += [
                f"{rel} imports {n}"
                for n in names
                if n == "engine_service.rpc" or n.startswith("engine_service.rpc.")
            ]
    return bad


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


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node ``start`` reaches through ``graph``'s arrows."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def circles_across_folders(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import each other in a circle (strongly connected) and span folders."""

    reached = {m: reachable(graph, m) for m in graph}
    groups = {frozenset({m} | {n for n in reached[m] if m in reached.get(n, ())}) for m in graph}
    return sorted(sorted(g) for g in groups if len({folder_of(m) for m in g}) > 1)


def room_of(module: str, package: str = "engine_service") -> str | None:
    """The room of ``package`` a module lives in (``engine_service.runtime`` for ``...runtime.runner``;
    a room's subfolders belong to it), None for the package's own modules (``__main__``, ``blas``, ...)
    and for other packages' modules."""
    parts = module.split(".")
    if parts[0] != package or len(parts) < 2 or not (ROOT / parts[0] / parts[1]).is_dir():
        return None
    return ".".join(parts[:2])


def room_graph(graph: dict[str, set[str]], package: str = "engine_service") -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        for name in imported:
            a, b = room_of(module, package), room_of(name, package)
            if a is not None and b is not None and a != b:
                rooms.setdefault(a, set()).add(b)
    return rooms


def room_circles(rooms: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(a, b) for each room a importing a room b that reaches a back: an arrow that runs back up."""

    return sorted((a, b) for a, targets in rooms.items() for b in targets if a in reachable(rooms, b))
