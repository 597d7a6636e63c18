"""The prefix service's snapshot directory (--snapshot_dir) on real engine and prefix servers: stored
prompts are written behind the request path and, after an engine restart or a prefix-service
restart, the first lookup is served from disk and continues exactly like a cold run; damaged or
partial files are never loaded; the byte budget evicts; the writer's queue drops when full."""

from __future__ import annotations

import time

import grpc

from prefix_service.engines.connect import connect_fleet
from prefix_service.engines.snapshot_files import EngineSnapshots
from prefix_service.rpc.server import create_server
from prefix_service.tier.persistent_tier import PersistentTier
from protos import engine_pb2 as epb
from protos import prefix_pb2, prefix_pb2_grpc
from tests.service.conftest import start_engine
from tests.service.helpers import in_process_tokens, wait_for

NEW = 4


def scraped_families(fleet):
    """The prefix service's metric families as a scrape would produce them."""
    from prefix_service.rpc.metrics import GatewayCollector

    return list(GatewayCollector(fleet).collect())


OWNER = (("forkline-owner", "alice"),)


class Service:
    """A prefix service over ``addresses`` with a snapshot directory."""

    def __init__(
        self, addresses, folder, *, max_bytes: int = 1 << 30, queue_size: int = 32, preload: int = 0
    ):
        self.tier = (
            PersistentTier.open(str(folder), max_bytes, queue_size=queue_size, preload=preload)
            if folder is not None
            else None
        )
        self.fleet, pool = connect_fleet(  # prompt snapshots only: the tests count their files
            lambda: set(addresses),
            ready_timeout=10,
            max_entries=16,
            tier=self.tier,
            resolve_every_s=60,
            cache_generated=False,
        )
        self.server, port = create_server(self.fleet, "127.0.0.1:0", pool=pool)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = prefix_pb2_grpc.PrefixCacheStub(self.channel)

    def generate(self, prompt: list[int]) -> tuple[list[int], epb.DoneEvent]:
        request = prefix_pb2.GatewayGenerateRequest(
            tokens=epb.TokenIds(ids=prompt),
            config=epb.GenerationConfig(max_new_tokens=NEW, temperature=0.0, ignore_eos=True),
        )
        events = list(self.stub.Generate(request, metadata=OWNER, timeout=30))
        return [t for e in events if e.HasField("tokens") for t in e.tokens.ids], events[-1].done

    def disk(self) -> prefix_pb2.SnapshotDirStats:
        return self.stub.Stats(prefix_pb2.StatsRequest()).snapshot_dir

    def stop(self, release: bool = True) -> None:
        self.channel.close()
        self.server.stop(0, release=release)


def prompt(i: int = 0) -> list[int]:
    return [ord(c) for c in f"{chr(65 + i)}: a system prompt worth keeping across restarts, of some length. "]


def test_an_engine_restart_is_served_from_disk_like_cold(engine_factory, tmp_path) -> None:
    engine = engine_factory()
    svc = Service([engine.address], tmp_path)
    restarted = None
    try:
        svc.generate(prompt())
        assert svc.tier.writer.flush(10) and svc.disk().written == 1 and svc.disk().files == 1
        engine.stop(0)  # gone, with every session
        restarted = start_engine(port=engine.port)  # a new instance at the same address
        longer = prompt() + [ord(c) for c in "And"]
        tokens, done = svc.generate(longer)
        assert done.reused_positions == len(prompt())  # restored from disk, then continued
        assert tokens == in_process_tokens(longer, NEW)
        assert svc.disk().restored == 1
        assert svc.stub.Stats(prefix_pb2.StatsRequest()).dropped_on_restart == 1  # memory was lost
        assert svc.tier.writer.flush(10)
        metrics = {
            (m.name, tuple(sorted(s.labels.items()))): s.value
            for m in scraped_families(svc.fleet)
            for s in m.samples
        }
        assert metrics["forkline_prefix_snapshot_events", (("event", "restored"),)] == 1
        assert metrics["forkline_prefix_snapshot_files", ()] == 2  # the first prompt and the longer one
    finally:
        svc.stop()
        if restarted is not None:
            restarted.stop(0)


def test_negative_control_without_a_directory_a_restart_recomputes(engine_factory) -> None:
    engine = engine_factory()
    svc = Service([engine.address], None)
    restarted = None
    try:
        svc.generate(prompt())
        engine.stop(0)
        restarted = start_engine(port=engine.port)
        assert svc.generate(prompt() + [ord("A")])[1].reused_positions == 0
    finally:
        svc.stop()
        if restarted is not None:
            restarted.stop(0)


def test_a_prefix_service_restart_rebuilds_its_index_from_the_folder(engine_factory, tmp_path) -> None:
    engine = engine_factory()
    first = Service([engine.address], tmp_path)
    for i in range(3):
        first.generate(prompt(i))
    assert first.tier.writer.flush(10)
    first.stop()  # releases its snapshots in the engine: only the files remain
    second = Service([engine.address], tmp_path)
    try:
        assert second.disk().files == 3
        for i in range(3):
            q = prompt(i) + [ord("?")]
            tokens, done = second.generate(q)
            assert done.reused_positions == len(prompt(i)) and tokens == in_process_tokens(q, NEW)
        assert second.tier.writer.flush(10)  # the files are written behind the request path
        assert second.disk().restored == 3 and second.disk().written == 3  # the longer prompts, stored anew
    finally:
        second.stop()


def test_preload_restores_before_the_first_lookup(engine_factory, tmp_path) -> None:
    engine = engine_factory()
    first = Service([engine.address], tmp_path)
    first.generate(prompt())
    assert first.tier.writer.flush(10)
    first.stop()
    second = Service([engine.address], tmp_path, preload=4)
    try:
        assert wait_for(lambda: second.disk().restored == 1)
        assert second.stub.Stats(prefix_pb2.StatsRequest()).entries == 1
    finally:
        second.stop()


def test_damaged_and_partial_files_are_never_loaded(engine_factory, tmp_path) -> None:
    engine = engine_factory()
    first = Service([engine.address], tmp_path)
    first.generate(prompt(0))
    first.generate(prompt(1))
    assert first.tier.writer.flush(10)
    first.stop()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 2
    flipped = bytearray(files[0].read_bytes())
    flipped[-64] ^= 0x10  # a K/V byte: the header still reads, the checksum does not
    files[0].write_bytes(bytes(flipped))
    (tmp_path / f".{files[1].name}.123.abcd.tmp").write_bytes(
        files[1].read_bytes()[:1000]
    )  # a crash mid-write
    second = Service([engine.address], tmp_path)
    try:
        assert not list(tmp_path.glob(".*.tmp"))  # the partial write is gone
        results = {}
        for i in range(2):
            q = prompt(i) + [ord("!")]
            tokens, done = second.generate(q)
            assert tokens == in_process_tokens(q, NEW)  # never a wrong continuation
            results[i] = done.reused_positions
        disk = second.disk()
        assert disk.refused == 1 and disk.discarded == 1 and disk.restored == 1
        assert sorted(results.values()) == [0, len(prompt(0))]  # the damaged one recomputed
        assert not files[0].exists() or not files[1].exists()  # the damaged file was deleted
    finally:
        second.stop()


def test_the_byte_budget_evicts_the_oldest(engine_factory, tmp_path) -> None:
    engine = engine_factory()
    probe = Service([engine.address], tmp_path / "probe")
    probe.generate(prompt(0))
    assert probe.tier.writer.flush(10)
    size = probe.disk().bytes
    probe.stop()
    svc = Service([engine.address], tmp_path / "small", max_bytes=int(size * 2.5))
    try:
        for i in range(4):
            svc.generate(prompt(i))
            assert svc.tier.writer.flush(10)
        disk = svc.disk()
        assert disk.files == 2 and disk.evicted == 2 and disk.bytes <= disk.max_bytes
        kept = {p.name for p in (tmp_path / "small").glob("*.safetensors")}
        assert len(kept) == 2
    finally:
        svc.stop()


def test_a_full_writer_queue_drops_and_counts(engine_factory, tmp_path, monkeypatch) -> None:
    engine = engine_factory()
    svc = Service([engine.address], tmp_path, queue_size=1)
    real = EngineSnapshots.export_session

    def slow(files, handle, extra, upto=None):
        time.sleep(0.5)
        return real(files, handle, extra, upto)

    monkeypatch.setattr(EngineSnapshots, "export_session", slow)
    try:
        for i in range(4):
            svc.generate(prompt(i))
        assert svc.tier.writer.flush(10)
        disk = svc.disk()
        assert disk.dropped >= 1 and disk.written + disk.dropped == 4
    finally:
        svc.stop()


def test_the_folder_can_mirror_one_cache(tmp_path) -> None:
    """The CLI's use (``clients/snapshot_dir.py``): retain deletes one configuration's files of one
    namespace whose keys the cache no longer holds, leaving the others; usage counts one
    configuration's files."""
    from prefix_service.tier.snapshot_store import SnapshotStore

    store = SnapshotStore(tmp_path, 1 << 20)
    for fingerprint, namespace, tokens, size in (
        ("fp-a", "ns", (1, 2, 3), 10),
        ("fp-a", "ns", (4, 5), 20),
        ("fp-a", "other", (6, 7), 30),
        ("fp-b", "ns", (1, 2, 3), 40),
    ):
        assert store.write(fingerprint, namespace, tokens, {}, [b"x" * size])
    assert store.usage("fp-a") == (3, 60) and store.usage("fp-b") == (1, 40)
    assert store.retain("fp-a", "ns", [(1, 2, 3)]) == 1
    assert store.usage("fp-a") == (2, 40) and store.usage("fp-b") == (1, 40)
    assert not store.holds("fp-a", "ns", (4, 5)) and store.holds("fp-a", "other", (6, 7))
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
