"""``ExportSession`` of a stored snapshot (a clone not generated since) answers while the engine
thread is inside a forward, in a real engine process whose forwards the test holds (``held_engine.py``):
the pinned export is copied on the RPC thread. Negative control: the same call for an ordinary session
(which generated) waits for that forward to end. ``upto`` exports a prefix: its positions and content
digest are the prefix's, and another engine imports it; an ``upto`` past the session or negative is
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from engine_service.api.content import content_digest
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc
from tests.service.held_engine import waiting_marker
from tests.service.helpers import wait_for
from tests.service.test_cluster_drain import HeldEngineProcess
from tests.service.test_routing_moves import TinyEngine

OWNER = (("forkline-owner", "prefix-service"),)  # a persistent owner: it may import too
PROMPT = [ord(c) for c in "pinned exports "]
PATIENCE_S = 120.0  # the deadline of every wait for a state: reached only when the state never comes


def timed_export(stub, session: str, upto: int | None = None) -> tuple[float, list[epb.SnapshotChunk]]:
    started = time.perf_counter()
    chunks = list(
        stub.ExportSession(epb.ExportSessionRequest(session=session, upto=upto), metadata=OWNER, timeout=30)
    )
    return time.perf_counter() - started, chunks


def test_a_stored_snapshot_exports_during_a_forward_and_an_ordinary_session_waits(tmp_path) -> None:
    engine, other = HeldEngineProcess(tmp_path / "hold", grace=5.0), TinyEngine(step_s=0.0)
    try:
        address = engine.listening(PATIENCE_S)
        with grpc.insecure_channel(address) as channel, grpc.insecure_channel(other.address) as ch2:
            stub = engine_pb2_grpc.EngineStub(channel)
            config = epb.GenerationConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True)
            request = epb.GenerateRequest(tokens=epb.TokenIds(ids=PROMPT), config=config, keep_session=True)
            events = list(stub.Generate(request, metadata=OWNER, timeout=60))
            source = next(e.started.session for e in events if e.HasField("started"))
            clone = stub.Clone(epb.CloneRequest(session=source, upto=len(PROMPT)), metadata=OWNER, timeout=30)
            assert clone.session and clone.position == len(PROMPT)
            busy = epb.GenerateRequest(
                tokens=epb.TokenIds(ids=[1, 2, 3]),
                config=epb.GenerationConfig(max_new_tokens=3, temperature=0.0, ignore_eos=True),
            )
            engine.hold_after(1)  # the busy prefill runs; its first decode forward waits
            load = threading.Thread(
                target=lambda: list(stub.Generate(busy, metadata=OWNER, timeout=5 * PATIENCE_S))
            )
            load.start()
            assert wait_for(waiting_marker(engine.hold).exists, PATIENCE_S)  # the engine thread is held
            pinned_s, pinned = timed_export(stub, clone.session, upto=9)
            assert waiting_marker(engine.hold).exists()  # it answered while the forward was held
            ordinary: list = []
            waiter = threading.Thread(target=lambda: ordinary.append(timed_export(stub, source)[1]))
            waiter.start()
            waiter.join(max(1.0, 3 * pinned_s))  # as long as the pinned export took, thrice
            assert waiter.is_alive()  # the ordinary export waits for the held forward
            engine.release()
            waiter.join(PATIENCE_S)
            load.join(PATIENCE_S)
            assert not waiter.is_alive() and not load.is_alive()
            (ordinary,) = ordinary
            for bad in (len(PROMPT) + 1, -1):  # past the committed positions, negative: the field named
                with pytest.raises(grpc.RpcError) as caught:
                    timed_export(stub, clone.session, upto=bad)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "upto" in caught.value.details()
            imported = engine_pb2_grpc.EngineStub(ch2).ImportSession(
                iter([epb.SnapshotChunk(data=c.data) for c in pinned]), metadata=OWNER, timeout=30
            )
        assert pinned[0].refusal == "" and ordinary[0].refusal == ""
        assert pinned[0].positions == 9 and pinned[0].content_digest == content_digest(PROMPT[:9])
        # the ordinary export holds the committed prompt (the generated token is pending, not written)
        assert ordinary[0].positions == len(PROMPT)
        assert imported.session and imported.refusal == ""
    finally:
        engine.kill()
        other.kill()
