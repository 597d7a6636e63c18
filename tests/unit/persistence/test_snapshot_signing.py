"""Signed snapshot files (issue 21 item 5, the engine's half): with a key the checksum is a keyed MAC.

The threat: whoever can write the snapshot folder can forge a *self-consistent* file -- another
prompt's content under this one's K/V, its content digest and plain checksum recomputed with the
public code. Without a key the reader accepts it (shown here, the negative control); with a key it is
``unsigned``, and a file whose MAC the key does not verify is ``bad_signature``, before any tensor is
copied out of the file. The key never appears in a repr, an error or a refusal, and neither does
the MAC the file should have had.
"""

from __future__ import annotations

import os
import pickle
import secrets
import struct

import mlx.core as mx
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.api.content import content_digest
from engine_service.api.errors import InvalidArgument
from engine_service.api.snapshot_files import LoadRefusal, SnapshotRefused, peek_snapshot
from engine_service.persistence import snapshot_file
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import (
    decode_snapshot,
    encode_snapshot,
    read_snapshot,
    write_snapshot,
)
from engine_service.persistence.snapshot_key import (
    MAC_ALGORITHM,
    MIN_SECRET_BYTES,
    SnapshotKey,
    read_snapshot_key,
)
from tests.unit.persistence.test_snapshot_file import CONTENT, flip_positions, snapshot

SECRET = secrets.token_urlsafe(32).encode()
KEY = SnapshotKey.from_secret(SECRET)
OTHER_KEY = SnapshotKey.from_secret(secrets.token_urlsafe(32).encode())
SPAIN = (5, 17, 99, 3, 42, 42, 8)  # the same length as CONTENT ("France"): the K/V shapes fit


def key_file(tmp_path, data: bytes = SECRET + b"\n", mode: int = 0o600, name: str = "key"):
    path = tmp_path / name
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def refused(data: bytes, key: SnapshotKey | None) -> SnapshotRefused:
    with pytest.raises(SnapshotRefused) as caught:
        decode_snapshot(data, "file", key=key)
    return caught.value


def forged(snap: SessionSnapshot, content: tuple[int, ...]) -> SessionSnapshot:
    """``snap``'s K/V under another content: what a writer of the folder builds with the public code."""
    return SessionSnapshot(snap.fingerprint, snap.layout, snap.state, content, snap.extra)


# ------------------------------------------------------------------------------------------ the key


def test_a_key_file_reads_and_never_shows_its_secret(tmp_path) -> None:
    key = read_snapshot_key(key_file(tmp_path))
    for text in (repr(key), str(key), f"{key}", repr([key])):
        assert "SnapshotKey(<secret>)" in text and SECRET.decode()[:8] not in text
    with pytest.raises(TypeError):
        pickle.dumps(key)
    # the trailing newline is not part of the secret: a file signed under one verifies under the other
    same = read_snapshot_key(key_file(tmp_path, SECRET, name="no-newline"))
    data = encode_snapshot(snapshot(), key=key)
    assert decode_snapshot(data, key=same).content == CONTENT
    assert read_snapshot_key(key_file(tmp_path, mode=0o640, name="group-readable")) is not None


@pytest.mark.parametrize(
    ("data", "mode", "problem"),
    [
        (b"short-secret-xyz\n", 0o600, f"has 16 bytes, at least {MIN_SECRET_BYTES} are needed"),
        (b"   \n", 0o600, "has 0 bytes"),
        (SECRET, 0o644, "readable or writable by others (mode 644)"),
        (SECRET, 0o604, "readable or writable by others"),
        (SECRET, 0o620, "readable or writable by others"),
        (SECRET * 200, 0o600, "too long for a snapshot key"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_file_never_its_contents(tmp_path, data, mode, problem) -> None:
    path = key_file(tmp_path, data, mode)
    with pytest.raises(InvalidArgument) as caught:
        read_snapshot_key(path)
    message = str(caught.value)
    assert str(path) in message and problem in message
    assert data.strip().decode() not in message if data.strip() else True
    assert SECRET.decode()[:8] not in message


def test_a_missing_key_file_is_refused(tmp_path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read the snapshot key"):
        read_snapshot_key(tmp_path / "absent")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        read_snapshot_key(tmp_path)


# ------------------------------------------------------------------------------------------ signed files


def test_a_signed_file_round_trips_and_says_it_is_signed(tmp_path) -> None:
    path = tmp_path / "a.safetensors"
    write_snapshot(path, snapshot(extra={"namespace": "ns"}), key=KEY)
    got = read_snapshot(path, key=KEY)
    assert got.content == CONTENT and dict(got.extra) == {"namespace": "ns"}
    meta = mx.load(str(path), return_metadata=True)[1]
    assert meta["mac"] == MAC_ALGORITHM
    assert peek_snapshot(path).signed and not peek_snapshot_unsigned(tmp_path).signed
    assert encode_snapshot(snapshot(), key=KEY) != encode_snapshot(snapshot(), key=OTHER_KEY)


def peek_snapshot_unsigned(tmp_path):
    path = tmp_path / "plain.safetensors"
    write_snapshot(path, snapshot())
    return peek_snapshot(path)


def test_the_signing_rule_both_ways(tmp_path) -> None:
    plain, signed = encode_snapshot(snapshot()), encode_snapshot(snapshot(), key=KEY)
    assert decode_snapshot(plain).content == CONTENT  # without a key: today's behaviour
    unsigned = refused(plain, KEY)
    assert unsigned.reason == LoadRefusal.UNSIGNED and "--snapshot_key" in unsigned.detail
    no_key = refused(signed, None)  # files written with a key never load into an engine without it
    assert no_key.reason == LoadRefusal.BAD_SIGNATURE and "no --snapshot_key" in no_key.detail
    wrong = refused(signed, OTHER_KEY)
    assert wrong.reason == LoadRefusal.BAD_SIGNATURE
    # the MAC the file should have had is never shown (a refusal is no signing oracle)
    path = tmp_path / "other.safetensors"
    write_snapshot(path, snapshot(), key=OTHER_KEY)
    mac = mx.load(str(path), return_metadata=True)[1]["checksum"]  # what OTHER_KEY computes here
    assert mac[:8] not in wrong.detail and SECRET.decode()[:8] not in wrong.detail


def test_a_forged_self_consistent_file_is_accepted_without_a_key_and_refused_with_one() -> None:
    france = snapshot()
    forgery = encode_snapshot(
        forged(france, SPAIN)
    )  # Spain's content, France's K/V, digest + checksum redone
    # the threat, without a key: the forgery loads and claims Spain's content over France's K/V
    got = decode_snapshot(forgery)
    assert got.content == SPAIN and got.content_digest == content_digest(SPAIN)
    assert all(mx.array_equal(got.state.arrays[n], a).item() for n, a in france.state.arrays.items())
    # with a key: unsigned, whatever the forger recomputed
    assert refused(forgery, KEY).reason == LoadRefusal.UNSIGNED
    # a forger who claims a MAC can only compute it under a key of their own
    assert (
        refused(encode_snapshot(forged(france, SPAIN), key=OTHER_KEY), KEY).reason
        == LoadRefusal.BAD_SIGNATURE
    )
    # control: the engine's own signed file of the same K/V loads
    assert decode_snapshot(encode_snapshot(france, key=KEY), key=KEY).content == CONTENT


def test_stripping_the_mac_of_a_signed_file_makes_it_unsigned(tmp_path) -> None:
    path = tmp_path / "a.safetensors"
    write_snapshot(path, snapshot(), key=KEY)
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.eval(list(arrays.values()))
    meta.pop("mac")
    with open(path, "wb") as f:
        mx.save_safetensors(f, arrays, metadata=meta)
    with pytest.raises(SnapshotRefused) as caught:
        read_snapshot(path, key=KEY)
    assert caught.value.reason == LoadRefusal.UNSIGNED
    with pytest.raises(SnapshotRefused) as plain:
        read_snapshot(path)  # nor is the keyed digest a valid plain checksum
    assert plain.value.reason == LoadRefusal.CHECKSUM


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Fail the test if any tensor is copied out of a file (``_to_mlx``) or, for ``unsigned``, hashed."""

    def boom(*_args, **_kwargs):
        raise AssertionError("a tensor was read before the file was vouched for")

    monkeypatch.setattr(snapshot_file, "_to_mlx", boom)
    return boom


def test_damage_to_a_signed_file_is_refused_before_any_tensor_is_read(no_tensor_reads) -> None:
    data = bytearray(encode_snapshot(snapshot(), key=KEY))
    with pytest.raises(AssertionError, match="before the file was vouched"):
        decode_snapshot(bytes(data), key=KEY)  # control: the patch is live (a good file reaches it)
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    reasons = set()
    for i in flip_positions(data):  # every region: length, header, metadata, every tensor
        flipped = bytearray(data)
        flipped[i] ^= 0x10
        reason = refused(bytes(flipped), KEY).reason
        reasons.add(reason)
        if i >= header_end:
            assert reason == LoadRefusal.BAD_SIGNATURE, i  # a tensor byte: the MAC catches it
    assert LoadRefusal.BAD_SIGNATURE in reasons
    # in the header a flip may also break the container, rename the format or the mac field
    allowed = {
        LoadRefusal.BAD_SIGNATURE,
        LoadRefusal.UNREADABLE,
        LoadRefusal.FORMAT_VERSION,
        LoadRefusal.UNSIGNED,
    }
    assert reasons <= allowed, reasons
    for cut in (len(data) - 1, len(data) // 2, header_end, 7):
        assert refused(bytes(data[:cut]), KEY).reason == LoadRefusal.UNREADABLE


def test_an_unsigned_or_keyless_case_is_refused_before_any_byte_is_hashed(
    monkeypatch, no_tensor_reads
) -> None:
    plain, signed = encode_snapshot(snapshot()), encode_snapshot(snapshot(), key=KEY)

    def no_hash(*_args, **_kwargs):
        raise AssertionError("hashed")

    monkeypatch.setattr(snapshot_file, "_digest", no_hash)
    assert refused(plain, KEY).reason == LoadRefusal.UNSIGNED
    assert refused(signed, None).reason == LoadRefusal.BAD_SIGNATURE
