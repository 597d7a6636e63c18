"""Signed snapshot files over ExportSession / ImportSession on real engine servers (issue 21 item 5,
the engine's half; the prefix service's folder comes later).

The forgery: France's exported file with Spain's prompt as its content (the same length), the
content digest and plain checksum recomputed with the public code. An engine without a key imports
it and its session claims Spain's prompt while continuing France's (the threat, shown); an engine
with ``--snapshot_key`` refuses it as ``unsigned``, one signed under another key as ``bad_signature``,
and a signed file as ``bad_signature`` when it has no key or another one -- each before any tensor
is read, leaving nothing behind. The key never shows in Info, the fingerprint, refusals or logs.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable

import grpc
import pytest

from engine_service.__main__ import main as engine_main
from engine_service.api.content import content_digest
from engine_service.persistence import snapshot_file
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import decode_snapshot, encode_snapshot
from engine_service.persistence.snapshot_key import SnapshotKey
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc
from tests.service.conftest import Engine
from tests.service.helpers import in_process_tokens
from tests.service.test_snapshot_rpc import SERVICE, kept_session

SECRET = secrets.token_urlsafe(32).encode()
KEY = SnapshotKey.from_secret(SECRET)
OTHER_KEY = SnapshotKey.from_secret(secrets.token_urlsafe(32).encode())
FRANCE = [ord(c) for c in "What is the capital of France?"]
SPAIN = [ord(c) for c in "What is the capital of Spain??"]  # the same length: France's K/V shapes fit
SUFFIX = [ord(c) for c in " Answer:"]
SAMPLED = {"temperature": 10.0, "seed": 7}  # the tiny model is peaked: sampling shows whose K/V it is


@pytest.fixture
def engines(engine_factory) -> Callable[..., Engine]:
    """``engines(key=None)``: an engine server over the tiny seeded model, signing with ``key``."""
    return lambda key=None: engine_factory(snapshot_key=key)


def stub(engine: Engine) -> engine_pb2_grpc.EngineStub:
    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(engine.address))


def exported(engine: Engine, prompt: list[int]) -> tuple[bytes, list[int]]:
    """The file of a session of ``engine`` holding ``prompt``, and what it holds."""
    session, held = kept_session(stub(engine), prompt, SERVICE)
    chunks = stub(engine).ExportSession(epb.ExportSessionRequest(session=session), metadata=SERVICE)
    return b"".join(c.data for c in chunks), held


def forge(
    data: bytes, content: list[int], key: SnapshotKey | None = None, sign: SnapshotKey | None = None
) -> bytes:
    """``data``'s K/V under ``content``; digest and checksum recomputed (a MAC only under ``sign``)."""
    real = decode_snapshot(data, key=key)
    assert real.positions == len(content)
    return encode_snapshot(
        SessionSnapshot(real.fingerprint, real.layout, real.state, tuple(content), real.extra), key=sign
    )


def imported(engine: Engine, data: bytes) -> epb.ImportSessionResponse:
    return stub(engine).ImportSession(iter([epb.SnapshotChunk(data=data)]), metadata=SERVICE)


def sampled(session_engine: Engine, session: str) -> list[int]:
    events = stub(session_engine).Generate(
        epb.GenerateRequest(
            session=session,
            tokens=epb.TokenIds(ids=SUFFIX),
            config=epb.GenerationConfig(max_new_tokens=8, ignore_eos=True, **SAMPLED),
        ),
        metadata=SERVICE,
    )
    return [t for e in events if e.HasField("tokens") for t in e.tokens.ids]


def cold(prompt: list[int]) -> list[int]:
    return in_process_tokens(prompt + SUFFIX, 8, **SAMPLED)


def test_without_a_key_a_forged_file_is_imported_and_answers_for_another_prompt(engines) -> None:
    """The threat (negative control): a self-consistent forgery passes every unkeyed check."""
    a, b = engines(), engines()
    data, held = exported(a, FRANCE)
    assert held == FRANCE
    reply = imported(b, forge(data, SPAIN))
    assert reply.session and not reply.refusal
    assert reply.content_digest == content_digest(SPAIN)  # it claims Spain's prompt...
    answer = sampled(b, reply.session)
    assert answer == cold(FRANCE) != cold(SPAIN)  # ...and continues France's


def test_with_a_key_the_forgery_is_unsigned_and_a_foreign_mac_bad(engines, monkeypatch) -> None:
    a, b = engines(KEY), engines(KEY)
    data, _ = exported(a, FRANCE)
    honest = imported(b, data)  # control: the engines share the key, the signed file loads
    assert honest.session and sampled(b, honest.session) == cold(FRANCE)
    resident = b.runner.resident_sessions
    plain_forgery = forge(data, SPAIN, key=KEY)  # no MAC: the forger has no key
    mac_forgery = forge(data, SPAIN, key=KEY, sign=OTHER_KEY)  # a MAC, under the forger's own key

    def no_tensor_reads(*_args, **_kwargs):
        raise AssertionError("a tensor was read before the file was vouched for")

    monkeypatch.setattr(snapshot_file, "_to_mlx", no_tensor_reads)
    unsigned = imported(b, plain_forgery)
    assert (unsigned.session, unsigned.refusal) == ("", "unsigned") and "--snapshot_key" in unsigned.detail
    bad = imported(b, mac_forgery)
    assert (bad.session, bad.refusal) == ("", "bad_signature")
    flipped = bytearray(data)
    flipped[len(flipped) - 100] ^= 0x01  # inside the last tensor: caught by the MAC, not later
    assert imported(b, bytes(flipped)).refusal == "bad_signature"
    assert imported(b, data[: len(data) // 2]).refusal == "unreadable"
    assert b.runner.resident_sessions == resident and b.deps.registry.usage("prefix-service").sessions == 1
    with pytest.raises(grpc.RpcError):  # control: the patch is live in the server (a good file reaches it)
        imported(b, data)
    for reply in (unsigned, bad):
        assert SECRET.decode()[:8] not in reply.detail


def test_signed_files_do_not_load_without_the_key_or_with_another(engines) -> None:
    signer, keyless, other = engines(KEY), engines(), engines(OTHER_KEY)
    data, _ = exported(signer, FRANCE)
    # the key is not in the fingerprint: the three engines publish the same one, so only the MAC
    # tells the files apart
    prints = {stub(e).Info(epb.InfoRequest(), metadata=SERVICE).fingerprint for e in (signer, keyless, other)}
    assert len(prints) == 1
    no_key = imported(keyless, data)
    assert (no_key.session, no_key.refusal) == ("", "bad_signature") and "no --snapshot_key" in no_key.detail
    assert imported(other, data).refusal == "bad_signature"
    plain, _ = exported(keyless, FRANCE)
    assert imported(signer, plain).refusal == "unsigned"  # files from before the key: refused, not trusted
    assert imported(engines(), plain).session  # control: keyless to keyless is today's behaviour


def test_the_key_never_shows_in_info_or_the_engines_answers(engines) -> None:
    engine = engines(KEY)
    info = stub(engine).Info(epb.InfoRequest(), metadata=SERVICE)
    wire = info.SerializeToString()
    assert SECRET not in wire and SECRET[:12] not in wire
    assert "SnapshotKey(<secret>)" in repr(engine.deps.snapshot_key) and SECRET.decode() not in repr(
        engine.deps
    )


def test_the_engine_refuses_a_bad_key_file_before_loading_the_model(tmp_path, capsys, caplog) -> None:
    loose = tmp_path / "key"
    loose.write_bytes(SECRET)
    os.chmod(loose, 0o644)
    missing_model = str(tmp_path / "no-such-model.gguf")
    assert engine_main(["--snapshot_key", str(loose), "--model", missing_model, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "readable or writable by others" in err and str(loose) in err and SECRET.decode() not in err
    os.chmod(loose, 0o600)  # a good key: the model is what fails now, and the log names only the file
    with caplog.at_level(logging.INFO):
        assert engine_main(["--snapshot_key", str(loose), "--model", missing_model, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and SECRET.decode() not in err
    assert f"signed with the key in {loose}" in caplog.text and SECRET.decode() not in caplog.text
