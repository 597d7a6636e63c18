"""ExportSession / ImportSession over gRPC on real engine servers: a session exported from one engine
and imported into another continues exactly like a cold run; a foreign engine refuses it with its
reason; only persistent owners may import; a corrupted stream is refused and nothing is left."""

from __future__ import annotations

import grpc
import pytest

from protos import engine_pb2 as epb
from protos import engine_pb2_grpc
from tests.service.helpers import PROMPT, in_process_tokens

CLIENT = (("forkline-owner", "alice"),)
SERVICE = (("forkline-owner", "prefix-service"),)
NEW = 4


def stub(engine) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(engine.address))


def kept_session(engine_stub, tokens: list[int], metadata) -> tuple[str, list[int]]:
    """A session holding ``tokens`` + the first generated token fed back: returns (handle, tokens held)."""
    events = list(
        engine_stub.Generate(
            epb.GenerateRequest(
                tokens=epb.TokenIds(ids=tokens),
                keep_session=True,
                config=epb.GenerationConfig(max_new_tokens=1, ignore_eos=True),
            ),
            metadata=metadata,
        )
    )
    done = events[-1].done
    generated = [t for e in events if e.HasField("tokens") for t in e.tokens.ids]
    return events[0].started.session, (tokens + generated)[: done.position]


def continue_on(engine_stub, session: str, tokens: list[int], metadata) -> list[int]:
    events = engine_stub.Generate(
        epb.GenerateRequest(
            session=session,
            tokens=epb.TokenIds(ids=tokens),
            config=epb.GenerationConfig(max_new_tokens=NEW, ignore_eos=True),
        ),
        metadata=metadata,
    )
    return [t for e in events if e.HasField("tokens") for t in e.tokens.ids]


def test_export_then_import_on_another_engine_continues_like_cold(engine_factory) -> None:
    a, b = engine_factory(), engine_factory()
    sa, sb = stub(a), stub(b)
    session, held = kept_session(sa, PROMPT, SERVICE)
    chunks = list(
        sa.ExportSession(
            epb.ExportSessionRequest(session=session, extra={"namespace": "ns"}), metadata=SERVICE
        )
    )
    assert (
        chunks[0].positions == len(held)
        and not chunks[0].refusal
        and chunks[0].file_bytes == sum(len(c.data) for c in chunks)
    )
    reply = sb.ImportSession(iter(chunks), metadata=SERVICE)
    assert reply.session and reply.positions == len(held) and reply.extra["namespace"] == "ns"
    assert reply.content_digest == chunks[0].content_digest
    assert b.deps.registry.usage("prefix-service").sessions == 1
    suffix = [ord(c) for c in " and then"]
    assert continue_on(sb, reply.session, suffix, SERVICE) == in_process_tokens(held + suffix, NEW)


def test_only_persistent_owners_import(engine_factory) -> None:
    a = engine_factory()
    sa = stub(a)
    session, _ = kept_session(sa, PROMPT, CLIENT)
    chunks = list(
        sa.ExportSession(epb.ExportSessionRequest(session=session), metadata=CLIENT)
    )  # own session: ok
    with pytest.raises(grpc.RpcError) as refused:
        sa.ImportSession(iter(chunks), metadata=CLIENT)
    assert (
        refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "persistent" in refused.value.details()
    )
    assert a.deps.registry.usage("alice").sessions == 1  # only the kept session


def test_another_callers_session_is_not_exported(engine_factory) -> None:
    a = engine_factory()
    sa = stub(a)
    session, _ = kept_session(sa, PROMPT, CLIENT)
    with pytest.raises(grpc.RpcError) as missing:
        list(
            sa.ExportSession(
                epb.ExportSessionRequest(session=session), metadata=(("forkline-owner", "mallory"),)
            )
        )
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_stream_is_refused_and_nothing_is_left(engine_factory, damage) -> None:
    a, b = engine_factory(), engine_factory()
    session, _ = kept_session(stub(a), PROMPT, SERVICE)
    chunks = list(stub(a).ExportSession(epb.ExportSessionRequest(session=session), metadata=SERVICE))
    data = bytearray(b"".join(c.data for c in chunks))
    if damage == "flip":
        data[len(data) - 100] ^= 0x01  # inside the last tensor
    else:
        del data[len(data) // 2 :]
    resident = b.runner.resident_sessions
    reply = stub(b).ImportSession(iter([epb.SnapshotChunk(data=bytes(data))]), metadata=SERVICE)
    assert not reply.session and reply.refusal == ("checksum" if damage == "flip" else "unreadable")
    assert b.runner.resident_sessions == resident and b.deps.registry.usage("prefix-service").sessions == 0


def test_an_engine_of_another_cache_kind_refuses_with_its_reason(engine_factory) -> None:
    a, cell = engine_factory(), engine_factory(cache_kind="batched-cell")
    session, _ = kept_session(stub(a), PROMPT, SERVICE)
    chunks = list(stub(a).ExportSession(epb.ExportSessionRequest(session=session), metadata=SERVICE))
    reply = stub(cell).ImportSession(iter(chunks), metadata=SERVICE)
    assert not reply.session and reply.refusal == "cache_kind"
