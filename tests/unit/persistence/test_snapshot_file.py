"""The snapshot file: a round trip keeps every byte and field; anything changed, cut, extended or of
another format version is refused with its reason; writes are atomic (no partial file under a name)."""

from __future__ import annotations

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.api.content import content_digest
from engine_service.api.snapshot_files import (
    FORMAT_VERSION,
    LoadRefusal,
    SnapshotRefused,
    StateLayout,
    list_snapshots,
    peek_snapshot,
    snapshot_name,
    write_snapshot_bytes,
)
from engine_service.cache.seq_state import SeqState
from engine_service.persistence import snapshot_file
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_file import (
    decode_snapshot,
    encode_snapshot,
    read_snapshot,
    write_snapshot,
)

LAYOUT = StateLayout(
    "batched-sequence", "layers=full,sliding:4;max_write=3;kv_heads=2;head_dim=8;dtype=float32"
)
CONTENT = (5, 17, 99, 3, 42, 42, 7)


def snapshot(dtype=mx.float32, extra=None) -> SessionSnapshot:
    rng = np.random.default_rng(0)
    arrays = {
        "layers.0.keys": mx.array(rng.standard_normal((2, 7, 8)).astype(np.float32)).astype(dtype),
        "layers.0.values": mx.array(rng.standard_normal((2, 7, 8)).astype(np.float32)).astype(dtype),
        "layers.1.keys": mx.array(rng.standard_normal((2, 6, 8)).astype(np.float32)).astype(dtype),
        "layers.1.values": mx.array(rng.standard_normal((2, 6, 8)).astype(np.float32)).astype(dtype),
    }
    mx.eval(list(arrays.values()))
    snap = SessionSnapshot("f" * 32, LAYOUT, SeqState(7, 9, arrays), CONTENT)
    return snap.with_extra(extra) if extra else snap


def refusal(path) -> LoadRefusal:
    with pytest.raises(SnapshotRefused) as caught:
        read_snapshot(path)
    assert str(path) in caught.value.detail
    return caught.value.reason


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_trip_keeps_every_field_and_byte(tmp_path, dtype) -> None:
    snap = snapshot(dtype, extra={"namespace": "ns", "priority": "high"})
    path = tmp_path / "a.safetensors"
    size = write_snapshot(path, snap)
    assert size == path.stat().st_size
    got = read_snapshot(path)
    assert got.fingerprint == snap.fingerprint and got.layout == LAYOUT and got.content == CONTENT
    assert (
        got.positions == 7
        and got.state.written == 9
        and dict(got.extra) == {"namespace": "ns", "priority": "high"}
    )
    assert got.content_digest == content_digest(CONTENT)
    assert set(got.state.arrays) == set(snap.state.arrays)
    for name, want in snap.state.arrays.items():
        have = got.state.arrays[name]
        assert have.dtype == dtype and have.shape == want.shape
        assert mx.array_equal(have, want).item()
    # the standard reader agrees with ours (a safetensors file any tool can open)
    arrays, meta = mx.load(str(path), return_metadata=True)
    assert meta["format_version"] == str(FORMAT_VERSION) and meta["positions"] == "7"
    assert mx.array_equal(arrays["content"], mx.array(CONTENT, dtype=mx.int32)).item()


def test_writes_leave_no_temporary_and_replace_atomically(tmp_path) -> None:
    path = tmp_path / snapshot_name("f" * 32, content_digest(CONTENT))
    write_snapshot(path, snapshot())
    write_snapshot(path, snapshot(extra={"second": "yes"}))  # over an existing file: replaced whole
    assert os.listdir(tmp_path) == [path.name]
    assert dict(read_snapshot(path).extra) == {"second": "yes"}
    assert list_snapshots(tmp_path) == [path]


def test_a_failed_write_leaves_nothing_under_the_name(tmp_path, monkeypatch) -> None:
    def crash(f, parts):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(snapshot_file, "_write_parts", crash)
    path = tmp_path / "a.safetensors"
    with pytest.raises(OSError, match="disk full"):
        write_snapshot(path, snapshot())
    assert os.listdir(tmp_path) == []


def test_listing_skips_temporaries_of_a_killed_writer(tmp_path) -> None:
    write_snapshot(tmp_path / "a.safetensors", snapshot())
    (tmp_path / ".b.safetensors.123.ab12.tmp").write_bytes(b"half a file")
    (tmp_path / "notes.txt").write_text("not a snapshot")
    assert [p.name for p in list_snapshots(tmp_path)] == ["a.safetensors"]


def test_truncated_extended_and_foreign_files_are_unreadable(tmp_path) -> None:
    path = tmp_path / "a.safetensors"
    write_snapshot(path, snapshot())
    data = path.read_bytes()
    cases = {
        "cut_in_data": data[:-5],
        "cut_in_header": data[:40],
        "cut_to_nothing": b"",
        "extended": data + b"\0" * 8,
        "not_safetensors": b"GGUF\x03\x00\x00\x00" + b"\0" * 64,
        "header_not_json": struct.pack("<Q", 4) + b"{{{{",
    }
    for name, raw in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(raw)
        assert refusal(bad) == LoadRefusal.UNREADABLE, name
    assert refusal(tmp_path / "missing.safetensors") == LoadRefusal.UNREADABLE


def rewrite_metadata(path, **changes) -> None:
    """Rewrite ``path`` with metadata fields changed and the tensors as they are (checksum unchanged)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.eval(list(arrays.values()))  # loads are lazy: read before the file is overwritten
    meta.update(changes)
    with open(path, "wb") as f:
        mx.save_safetensors(f, arrays, metadata=meta)


def test_another_format_version_is_refused_as_such(tmp_path) -> None:
    path = tmp_path / "a.safetensors"
    write_snapshot(path, snapshot())
    rewrite_metadata(path, format_version=str(FORMAT_VERSION + 1))
    assert refusal(path) == LoadRefusal.FORMAT_VERSION
    rewrite_metadata(path, format_version=str(FORMAT_VERSION), format="someone-elses-cache")
    assert refusal(path) == LoadRefusal.FORMAT_VERSION
    rewrite_metadata(path, format="forkline-session-snapshot")
    read_snapshot(path)  # control: restored fields read again


@pytest.mark.parametrize("field", ["fingerprint", "positions", "cache_kind", "extra"])
def test_a_changed_metadata_field_fails_the_checksum(tmp_path, field) -> None:
    path = tmp_path / "a.safetensors"
    write_snapshot(path, snapshot())
    value = {"fingerprint": "0" * 32, "positions": "6", "cache_kind": "batched-cell", "extra": '{"a": "b"}'}[
        field
    ]
    rewrite_metadata(path, **{field: value})
    assert refusal(path) == LoadRefusal.CHECKSUM


def flip_positions(data: bytes) -> list[int]:
    """Bytes to flip, spread over every region of a snapshot file: each byte of the length prefix, the
    first, middle and last character of every key and value in the JSON header (metadata, dtypes,
    shapes, offsets), the header's first and last bytes (its padding), and each tensor's first, middle
    and last bytes."""
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    text = data[8:header_end].decode()
    header = json.loads(text)
    positions = set(range(8)) | {8, header_end - 1}
    at = 0

    def mark(token: str) -> None:
        nonlocal at
        start = text.index(token, at)  # json.loads keeps the file's order: search onwards
        positions.update(8 + start + k for k in (0, len(token) // 2, len(token) - 1))
        at = start + len(token)

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                mark(json.dumps(key))
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        else:
            mark(json.dumps(value))

    walk(header)
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = (header_end + offset for offset in entry["data_offsets"])
            positions.update({start, (start + end) // 2, end - 1})
    return sorted(positions)


def test_flip_positions_cover_every_region() -> None:
    data = encode_snapshot(snapshot())
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    positions = flip_positions(data)
    assert set(range(8)) <= set(positions) and positions[-1] == len(data) - 1
    assert len(positions) < len(data) // 4  # a sample, not every byte
    meta = json.loads(data[8:header_end])["__metadata__"]
    for key, value in meta.items():  # a character inside every metadata value, even a one-character one
        token = json.dumps(value).encode()
        value_at = data.index(token, data.index(json.dumps(key).encode()))
        assert set(range(value_at + 1, value_at + len(token) - 1)) & set(positions), key


def test_flipped_bytes_are_refused(tmp_path) -> None:
    """No single flipped bit in any region of a small file (length, header, metadata, padding, every
    tensor) reads back as a snapshot."""
    path = tmp_path / "a.safetensors"
    write_snapshot(path, snapshot())
    data = bytearray(path.read_bytes())
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    bad = tmp_path / "bad.safetensors"
    reasons = set()
    for i in flip_positions(data):
        flipped = bytearray(data)
        flipped[i] ^= 0x10
        bad.write_bytes(flipped)
        reason = refusal(bad)
        reasons.add(reason)
        if i >= header_end:
            assert reason == LoadRefusal.CHECKSUM, i  # a tensor byte
    assert LoadRefusal.CHECKSUM in reasons and LoadRefusal.UNREADABLE in reasons


def test_a_writer_bug_in_the_content_is_refused_even_when_checksummed(tmp_path, monkeypatch) -> None:
    path = tmp_path / "a.safetensors"
    snap = snapshot()
    monkeypatch.setattr(SessionSnapshot, "content_digest", property(lambda self: b"\0" * 16))
    write_snapshot(path, snap)
    monkeypatch.undo()
    assert refusal(path) == LoadRefusal.CONTENT
    meta = mx.load(str(path), return_metadata=True)[1]
    assert json.loads(meta["extra"]) == {}


def test_encoded_bytes_are_the_file_and_travel_as_is(tmp_path) -> None:
    """What an RPC would stream: the file's bytes; written verbatim elsewhere they read back the same."""
    snap = snapshot(extra={"namespace": "ns"})
    write_snapshot(tmp_path / "a.safetensors", snap)
    data = encode_snapshot(snap)
    assert data == (tmp_path / "a.safetensors").read_bytes()
    assert write_snapshot_bytes(tmp_path / "b.safetensors", data) == len(data)
    got = read_snapshot(tmp_path / "b.safetensors")
    assert got.content == CONTENT and dict(got.extra) == {"namespace": "ns"}
    assert decode_snapshot(data).content_digest == snap.content_digest
    with pytest.raises(SnapshotRefused) as caught:
        decode_snapshot(data[:-1], "from engine X")
    assert caught.value.reason == LoadRefusal.UNREADABLE and "from engine X" in caught.value.detail


def test_peek_reads_the_header_only(tmp_path) -> None:
    path = tmp_path / "a.safetensors"
    write_snapshot(path, snapshot(extra={"namespace": "ns"}))
    info = peek_snapshot(path)
    assert (info.fingerprint, info.layout, info.positions) == ("f" * 32, LAYOUT, 7)
    assert info.content_digest == content_digest(CONTENT).hex() and dict(info.extra) == {"namespace": "ns"}
    assert info.file_bytes == path.stat().st_size
    path.write_bytes(path.read_bytes()[:-10])  # a cut body: the header still reads (peek verifies nothing)
    assert peek_snapshot(path).positions == 7
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(SnapshotRefused) as caught:
        peek_snapshot(tmp_path / "junk.safetensors")
    assert caught.value.reason == LoadRefusal.UNREADABLE
