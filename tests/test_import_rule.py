"""Domain code never imports grpc, the generated protos or prometheus_client: only ``*/rpc/`` modules,
the shared gRPC kit ``engine_service/serving/``, the prefix service's engine clients
``prefix_service/engines/`` (and ``clients/``) do; metrics are read from the domain (counters, stats)
by collectors in ``rpc/``. Each room stays behind its walls and the engine's doors, with no import
circle across folders or rooms. The rules: ``tests/import_rules.py``; the AST walk: ``tests/import_walk.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import import_walk
from tests.import_rules import ENGINE_DOORS, PREFIX_WALLS, WALLS
from tests.import_walk import (
    ROOT,
    circles_across_folders,
    crossings,
    domain_modules,
    door_crossings,
    engine_imports_outside,
    forbidden_imports,
    module_graph,
    modules_under,
    room_circles,
    room_graph,
    rpc_importers,
)


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
    monkeypatch.setattr(import_walk, "ROOT", tmp_path)
    flagged = {line.split(" imports ")[0].rpartition("/")[2] for line in crossings(folder, forbidden)}
    assert flagged == set(sources)


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
    monkeypatch.setattr(import_walk, "ROOT", tmp_path)
    assert rpc_importers() == [
        "engine_service/sessions/x.py imports engine_service.rpc",
        "engine_service/sessions/x.py imports engine_service.rpc.convert",
    ]


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
