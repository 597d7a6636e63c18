"""``ExportSession`` of a stored snapshot (a clone not generated since) answers while the engine
thread is inside a forward, in a real engine process whose forwards take 2 s (``tiny_engine.py``):
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
from tests.service.test_routing_moves import TinyEngine

STEP_S = 2.0
OWNER = (("forkline-owner", "prefix-service"),)  # a persistent owner: it may import too
PROMPT = [ord(c) for c in "pinned exports "]


def timed_export(stub, session: str, upto: int | None = None) -> tuple[float, list[epb.SnapshotChunk]]:
    started = time.perf_counter()
    chunks = list(
        stub.ExportSession(epb.ExportSessionRequest(session=session, upto=upto), metadata=OWNER, timeout=30)
    )
    return time.perf_counter() - started, chunks


def test_a_stored_snapshot_exports_during_a_forward_and_an_ordinary_session_waits() -> None:
    engine, other = TinyEngine(step_s=STEP_S), TinyEngine(step_s=0.0)
    try:
        with grpc.insecure_channel(engine.address) as channel, grpc.insecure_channel(other.address) as ch2:
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
            load = threading.Thread(target=lambda: list(stub.Generate(busy, metadata=OWNER, timeout=60)))
            load.start()
            time.sleep(0.5)  # the engine thread is now inside a 2 s forward
            pinned_s, pinned = timed_export(stub, clone.session, upto=9)
            waited_s, ordinary = timed_export(stub, source)
            load.join(60)
            for bad in (len(PROMPT) + 1, -1):  # past the committed positions, negative: the field named
                with pytest.raises(grpc.RpcError) as caught:
                    timed_export(stub, clone.session, upto=bad)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "upto" in caught.value.details()
            imported = engine_pb2_grpc.EngineStub(ch2).ImportSession(
                iter([epb.SnapshotChunk(data=c.data) for c in pinned]), metadata=OWNER, timeout=30
            )
        assert pinned[0].refusal == "" and ordinary[0].refusal == ""
        assert pinned_s < 0.5 * STEP_S < waited_s, (pinned_s, waited_s)
        assert pinned[0].positions == 9 and pinned[0].content_digest == content_digest(PROMPT[:9])
        # the ordinary export holds the committed prompt (the generated token is pending, not written)
        assert ordinary[0].positions == len(PROMPT)
        assert imported.session and imported.refusal == ""
    finally:
        engine.kill()
        other.kill()
