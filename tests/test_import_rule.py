"""Domain code never imports grpc, the generated protos or prometheus_client: only ``*/rpc/`` modules,
the shared gRPC kit ``engine_service/serving/``, the prefix service's engine clients
``prefix_service/engines/`` (and ``clients/``) do; metrics are read from the domain (counters, stats)
by collectors in ``rpc/``."""

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


# The folders of each package that speak gRPC: its adapter, the shared kit, the engine clients.
GRPC_FOLDERS = {"engine_service": ("rpc", "serving"), "prefix_service": ("rpc", "engines")}


def domain_modules() -> list[Path]:
    files = []
    for package, grpc_folders in GRPC_FOLDERS.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT / package).parts[0] not in grpc_folders:
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


# The prefix service's rooms: the cache is the bottom room (it imports no other room of the service);
# the gateway is domain code below both doors.
PREFIX_WALLS = [
    *[
        ("prefix_service/cache", f"prefix_service.{room}")
        for room in ("gateway", "fleet", "tier", "engines", "rpc", "http")
    ],
    ("prefix_service/gateway", "prefix_service.rpc"),
    ("prefix_service/gateway", "prefix_service.http"),
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


@pytest.mark.parametrize(("folder", "forbidden"), PREFIX_WALLS, ids=[f"{f}!->{x}" for f, x in PREFIX_WALLS])
def test_prefix_room_does_not_import_across_its_wall(folder: str, forbidden: str) -> None:
    assert modules_under(folder), f"{folder} holds no modules"
    assert crossings(folder, forbidden) == []


@pytest.mark.parametrize(("folder", "forbidden"), PREFIX_WALLS, ids=[f"{f}!->{x}" for f, x in PREFIX_WALLS])
def test_prefix_wall_checker_sees_a_crossing(folder: str, forbidden: str, tmp_path, monkeypatch) -> None:
    """Negative control, one per wall: a module of ``folder`` importing the forbidden room (absolute,
    from-import, relative, or only under TYPE_CHECKING) is flagged."""
    room = forbidden.rpartition(".")[2]
    (tmp_path / folder).mkdir(parents=True)
    sources = {
        "a.py": f"import {forbidden}.x\n",
        "b.py": f"from {forbidden} import x\n",
        "c.py": f"from ..{room} import x\n",
        "d.py": f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {forbidden}.x import Y\n",
    }
    for name, source in sources.items():
        (tmp_path / folder / name).write_text(source)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    flagged = {line.split(" imports ")[0].rpartition("/")[2] for line in crossings(folder, forbidden)}
    assert flagged == set(sources)


# (folder, the only engine_service modules it may import): the prefix service sees the engine through
# its api and the shared serving kit; api is the floor (it imports nothing else of the engine); the
# serving kit knows the api and nothing of the engine's rooms.
ENGINE_DOORS = [
    ("prefix_service", ("engine_service.api", "engine_service.serving")),
    ("engine_service/api", ("engine_service.api",)),
    ("engine_service/serving", ("engine_service.api", "engine_service.serving")),
]


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


@pytest.mark.parametrize(("folder", "allowed"), ENGINE_DOORS, ids=[f for f, _ in ENGINE_DOORS])
def test_folder_imports_the_engine_only_through_its_doors(folder: str, allowed: tuple[str, ...]) -> None:
    assert modules_under(folder), f"{folder} holds no modules"
    assert door_crossings(folder, allowed) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from engine_service.api.errors import NotFound", []),
        ("from engine_service.serving import engine_wire", []),
        ("import engine_service", ["engine_service"]),  # the package: not a door
        ("from engine_service import errors", ["engine_service", "engine_service.errors"]),
        (
            "from engine_service.runtime.runner import Runner",
            ["engine_service.runtime.runner", "engine_service.runtime.runner.Runner"],
        ),
        (
            "from engine_service.sessions.handles import HandleRegistry",
            ["engine_service.sessions.handles", "engine_service.sessions.handles.HandleRegistry"],
        ),
        ("import engine_service.rpc.convert", ["engine_service.rpc.convert"]),
        ("from protos import engine_pb2", []),
    ],
)
def test_door_checker_sees_every_way_in(source: str, expected: list[str]) -> None:
    """Negative control: each form of reaching past the doors is flagged, the doors are not."""
    allowed = ("engine_service.api", "engine_service.serving")
    assert engine_imports_outside(source, "prefix_service", allowed) == expected


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


def test_only_the_engine_main_imports_the_engine_adapter() -> None:
    """``engine_service/rpc`` is the engine's gRPC adapter: its __main__ (and clients and tests, which are
    not services) build a server from it; no other service code reaches into it."""
    assert rpc_importers() == []


def test_rpc_importer_check_sees_an_import(tmp_path, monkeypatch) -> None:
    """Negative control: the same check over a tree where sessions/ imports the adapter flags it."""
    (tmp_path / "engine_service" / "sessions").mkdir(parents=True)
    (tmp_path / "engine_service" / "sessions" / "x.py").write_text("from engine_service.rpc import convert\n")
    (tmp_path / "engine_service" / "__main__.py").write_text(
        "from engine_service.rpc.server import create_server\n"
    )
    (tmp_path / "prefix_service").mkdir()
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert rpc_importers() == [
        "engine_service/sessions/x.py imports engine_service.rpc",
        "engine_service/sessions/x.py imports engine_service.rpc.convert",
    ]


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


def test_the_engine_rooms_stand_in_floors() -> None:
    """No engine room imports a room that imports it back, through any files: api at the bottom, then
    cache, model, executors, persistence, runtime, sessions; serving beside them; rpc on top."""
    rooms = room_graph(module_graph())
    seen = set(rooms).union(*rooms.values())
    assert {
        "engine_service.api",
        "engine_service.serving",
        "engine_service.sessions",
        "engine_service.rpc",
    } <= seen
    assert room_circles(rooms) == []


def test_room_circle_finder_sees_two_files_that_close_a_circle() -> None:
    """Negative control: runtime.a -> persistence.b and persistence.c -> runtime.d is no circle of
    files, yet the rooms import each other: reported."""
    graph = {
        "engine_service.runtime.runner": {"engine_service.persistence.snapshot"},
        "engine_service.persistence.sessions": {"engine_service.runtime.session"},
        "engine_service.__main__": {"engine_service.rpc.server"},
    }
    assert circles_across_folders(graph) == []
    assert room_circles(room_graph(graph)) == [
        ("engine_service.persistence", "engine_service.runtime"),
        ("engine_service.runtime", "engine_service.persistence"),
    ]


def test_the_prefix_rooms_stand_in_floors() -> None:
    """No room of the prefix service imports a room that imports it back, through any files: cache at
    the bottom, then tier, gateway, fleet, engines; http and rpc on top (no file circle spans two of
    its folders either: test_no_import_circle_between_folders)."""
    rooms = room_graph(module_graph(), "prefix_service")
    seen = set(rooms).union(*rooms.values())
    assert {
        f"prefix_service.{room}" for room in ("cache", "tier", "gateway", "fleet", "engines", "rpc", "http")
    } <= seen
    assert room_circles(rooms) == []


def test_prefix_circle_finders_see_a_circle_of_files_and_of_rooms() -> None:
    """Negative control: two prefix files of different folders importing each other are a circle
    across folders; gateway.a -> tier.b and tier.c -> gateway.d is no circle of files, yet the rooms
    import each other."""
    files = {
        "prefix_service.gateway.stream": {"prefix_service.fleet.fleet"},
        "prefix_service.fleet.fleet": {"prefix_service.gateway.stream"},
    }
    assert circles_across_folders(files) == [["prefix_service.fleet.fleet", "prefix_service.gateway.stream"]]
    rooms = {
        "prefix_service.gateway.gateway": {"prefix_service.tier.persistent_tier"},
        "prefix_service.tier.snapshot_store": {"prefix_service.gateway.calls"},
    }
    assert circles_across_folders(rooms) == []
    assert room_circles(room_graph(rooms, "prefix_service")) == [
        ("prefix_service.gateway", "prefix_service.tier"),
        ("prefix_service.tier", "prefix_service.gateway"),
    ]
