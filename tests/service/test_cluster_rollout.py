"""Rolling an engine with the manifests' settings, on real servers: the prefix service keeps its snapshot
folder (--snapshot_dir) and preloads into an engine that joins (--snapshot_preload); the old engine
drains (Info draining, health NOT_SERVING) and leaves, its replacement (a new instance at a new
address, as a rescheduled pod gets) joins and is served from the files: the first lookups after the
roll reuse every stored prompt. Control: without the folder the replacement starts cold."""

from __future__ import annotations

import grpc
import pytest

from prefix_service.engines.connect import connect_fleet
from prefix_service.rpc.server import create_server
from prefix_service.tier.persistent_tier import PersistentTier
from protos import prefix_pb2_grpc
from tests.service.helpers import in_process_tokens, wait_for
from tests.service.test_snapshot_dir import NEW, Service, prompt


class RolledService(Service):
    """Service over a mutable address list (the DNS answer), preloading 8 files into a joining engine."""

    def __init__(self, addresses: list[str], folder) -> None:
        self.addresses = addresses
        self.tier = PersistentTier.open(str(folder), 1 << 30, preload=8) if folder is not None else None
        self.fleet, self.pool = connect_fleet(  # prompt snapshots only: the test counts their files
            lambda: set(self.addresses),
            ready_timeout=10,
            max_entries=16,
            tier=self.tier,
            resolve_every_s=60,
            cache_generated=False,
        )
        self.server, port = create_server(self.fleet, "127.0.0.1:0", pool=self.pool)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = prefix_pb2_grpc.PrefixCacheStub(self.channel)


def roll(service: RolledService, old, new) -> None:
    """What a StatefulSet rollout does to one engine, as the prefix service sees it."""
    old.deps.drain()  # SIGTERM (after preStop): Info says draining, health NOT_SERVING
    old.server.health_state.update(draining=True)
    assert wait_for(lambda: (service.pool.check_departures(), len(service.fleet.members()))[1] == 0)
    service.addresses[:] = [new.address]  # the new pod's address in DNS
    service.pool.sync()
    assert [m.name for m in service.fleet.members()] == [new.address]


@pytest.mark.parametrize("with_folder", [True, False], ids=["snapshot_dir", "control-no-folder"])
def test_a_rolled_engine_is_served_from_the_snapshot_folder(engine_factory, tmp_path, with_folder) -> None:
    old, new = engine_factory(), engine_factory()
    service = RolledService([old.address], tmp_path if with_folder else None)
    try:
        for i in range(3):
            service.generate(prompt(i))
        if with_folder:
            assert service.tier.writer.flush(10)
        roll(service, old, new)
        if with_folder:
            assert wait_for(lambda: service.disk().restored == 3)  # preloaded as it joined
        reused = []
        for i in range(3):
            q = prompt(i) + [ord("?")]
            tokens, done = service.generate(q)
            assert tokens == in_process_tokens(q, NEW) and done.engine == new.address
            reused.append(done.reused_positions)
        assert reused == ([len(prompt(i)) for i in range(3)] if with_folder else [0, 0, 0])
    finally:
        service.stop()
