"""The import rules: what domain code may not import, the walls between rooms, the engine's doors."""

from __future__ import annotations

FORBIDDEN = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "grpc_tools",
    "protos",
    "google.protobuf",
    "prometheus_client",
)


# The folders of each package that speak gRPC: its adapter, the shared kit, the engine clients.
GRPC_FOLDERS = {"engine_service": ("rpc", "serving"), "prefix_service": ("rpc", "engines")}


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


# (folder, the only engine_service modules it may import): the prefix service sees the engine through
# its api and the shared serving kit; api is the floor (it imports nothing else of the engine); the
# serving kit knows the api and nothing of the engine's rooms.
ENGINE_DOORS = [
    ("prefix_service", ("engine_service.api", "engine_service.serving")),
    ("engine_service/api", ("engine_service.api",)),
    ("engine_service/serving", ("engine_service.api", "engine_service.serving")),
]
