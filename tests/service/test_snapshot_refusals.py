"""A snapshot file the engine refuses for good is deleted and its prompt persisted again (issue 21 item
5, the prefix service's half), on real engine and prefix servers sharing one --snapshot_dir.

Before, the tier deleted only ``unreadable`` / ``checksum`` / ``content`` / ``format_version`` files,
and its writer skips the keys the folder holds: a file refused with ``shape`` (or, on engines with
``--snapshot_key``, an ``unsigned`` / ``bad_signature`` forgery) stayed under its prompt's key forever,
never replaced, and every restart refused it again. Both scenarios below fail on that code. The
negative control: a file of another configuration (another fingerprint) is left alone.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from clients.engine_client import EngineClient
from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.content import content_digest
from engine_service.api.snapshot_files import snapshot_name
from engine_service.cache.seq_state import SeqState
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import decode_snapshot, encode_snapshot
from engine_service.persistence.snapshot_key import SnapshotKey
from prefix_service.tier.persistent_tier import KEPT
from protos import engine_pb2 as epb
from protos import prefix_pb2
from tests.service.conftest import Engine
from tests.service.helpers import in_process_tokens
from tests.service.test_snapshot_dir import NEW, OWNER, Service

KEY = SnapshotKey.from_secret(secrets.token_urlsafe(32).encode())
FRANCE = [ord(c) for c in "System: be brief. What is the capital of France?"]
SPAIN = [ord(c) for c in "System: be brief. What is the capital of Spain??"]  # France's length


@pytest.fixture
def engines(engine_factory) -> Callable[..., Engine]:
    """``engines(key=None)``: an engine server over the tiny seeded model, signing with ``key``."""
    return lambda key=None: engine_factory(snapshot_key=key)


def only_file(folder: Path) -> Path:
    (path,) = folder.glob("*.safetensors")
    return path


def rewritten(path: Path, change, key: SnapshotKey | None = None, sign: SnapshotKey | None = None) -> None:
    """Replace the file at ``path`` by ``change(snapshot)``, self-consistent: digest and checksum
    recomputed with the public code (a MAC only under ``sign``), its key (extra) unchanged."""
    real = decode_snapshot(path.read_bytes(), key=key)
    path.write_bytes(encode_snapshot(change(real), key=sign))


def one_row_short(snapshot: SessionSnapshot) -> SessionSnapshot:
    """The same snapshot with one K/V tensor a head_dim column short: refused with ``shape``."""
    state = snapshot.state
    arrays = dict(state.arrays)
    name = next(n for n in sorted(arrays) if n.endswith(".keys"))
    arrays[name] = mx.contiguous(mx.array(arrays[name])[..., :-1])
    return SessionSnapshot(
        snapshot.fingerprint,
        snapshot.layout,
        SeqState(state.length, state.written, arrays),
        snapshot.content,
        snapshot.extra,
    )


def kept(client: EngineClient) -> str:
    return (
        client.generate([65, 66], config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )


def restarted_service(engine: Engine, folder: Path) -> Service:
    """A prefix service over ``folder`` after a restart: its memory cache is empty, the folder is not."""
    return Service([engine.address], folder)


def test_a_shape_refusal_deletes_the_file_and_the_prompt_is_persisted_again(engines, tmp_path) -> None:
    engine = engines()
    first = Service([engine.address], tmp_path)
    first.generate(FRANCE)
    assert first.tier.writer.flush(10) and first.disk().written == 1
    first.stop()
    path = only_file(tmp_path)
    rewritten(path, one_row_short)
    bad = path.read_bytes()

    second = restarted_service(engine, tmp_path)
    try:
        tokens, done = second.generate(FRANCE)
        assert tokens == in_process_tokens(FRANCE, NEW) and done.reused_positions == 0  # computed again
        assert second.tier.writer.flush(10)
        disk = second.disk()
        assert disk.refused == 1 and disk.discarded == 1  # before: refused, not discarded
        assert disk.written == 1 and disk.files == 1  # before: 0 written (the writer skipped the key)
        assert path.exists() and path.read_bytes() != bad  # a new, good file under the prompt's name
    finally:
        second.stop()

    third = restarted_service(engine, tmp_path)  # the next restart is served from the new file
    try:
        tokens, done = third.generate(FRANCE)
        assert done.reused_positions == len(FRANCE) - 1 and tokens == in_process_tokens(FRANCE, NEW)
        assert third.disk().restored == 1 and third.disk().refused == 0
    finally:
        third.stop()


def test_with_a_key_a_forged_file_is_refused_deleted_and_the_true_answer_persisted(engines, tmp_path) -> None:
    """The folder's writer forges Spain's file from France's signed one (France's K/V, Spain's
    content, digest and plain checksum recomputed). Engines with --snapshot_key refuse it
    (``unsigned``); the tier deletes it and stores Spain's own snapshot, signed."""
    engine = engines(KEY)
    first = Service([engine.address], tmp_path)
    first.generate(FRANCE)
    assert first.tier.writer.flush(10)
    first.stop()
    france = only_file(tmp_path)
    real = decode_snapshot(france.read_bytes(), key=KEY)
    spain_extra = dict(real.extra) | {"forkline.tokens": ",".join(map(str, SPAIN)).join("[]")}
    forged = SessionSnapshot(real.fingerprint, real.layout, real.state, tuple(SPAIN), spain_extra)
    spain = tmp_path / snapshot_name(real.fingerprint, content_digest(SPAIN))
    spain.write_bytes(encode_snapshot(forged))  # unsigned: what anyone with the public code can make
    france.unlink()

    second = restarted_service(engine, tmp_path)
    try:
        assert second.disk().files == 1  # indexed: its header claims Spain's prompt
        tokens, done = second.generate(SPAIN)
        assert tokens == in_process_tokens(SPAIN, NEW) and done.reused_positions == 0  # Spain's answer
        assert second.tier.writer.flush(10)
        disk = second.disk()
        assert disk.refused == 1 and disk.discarded == 1 and disk.written == 1  # before: 1, 0, 0
    finally:
        second.stop()
    assert decode_snapshot(spain.read_bytes(), key=KEY).content == tuple(SPAIN)  # signed, genuine

    third = restarted_service(engine, tmp_path)
    try:
        tokens, done = third.generate(SPAIN)
        assert done.reused_positions == len(SPAIN) - 1 and tokens == in_process_tokens(SPAIN, NEW)
    finally:
        third.stop()


def test_negative_control_a_refusal_of_the_engines_state_now_leaves_the_file(engines, tmp_path) -> None:
    """``no_room`` (the engine is full now) is no verdict on the file: it stays, and the next lookup
    once the engine has room restores it."""
    engine = engines()
    first = Service([engine.address], tmp_path)
    first.generate(FRANCE)
    assert first.tier.writer.flush(10)
    first.stop()
    path = only_file(tmp_path)
    good = path.read_bytes()
    assert {"no_room", "fingerprint", "cache_kind", "geometry"} <= KEPT
    second = restarted_service(engine, tmp_path)
    alice = EngineClient(engine.address, owner="alice")
    held = [kept(alice) for _ in range(8)]  # the engine's 8 sessions
    try:
        request = prefix_pb2.LookupRequest(tokens=epb.TokenIds(ids=FRANCE))
        missed = second.stub.Lookup(request, metadata=OWNER, timeout=30)
        assert not missed.session and second.disk().refused == 1 and second.disk().discarded == 0
        assert path.read_bytes() == good  # left alone
        for session in held:
            alice.close(session)
        hit = second.stub.Lookup(request, metadata=OWNER, timeout=30)
        assert hit.session and hit.reused == len(FRANCE) - 1 and second.disk().restored == 1
        second.fleet.sole().close_session(hit.session, CallContext("alice"))
    finally:
        alice.close_channel()
        second.stop()
