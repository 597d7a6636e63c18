"""The snapshot file (safetensors: ``content`` int32 [positions] and the cache kind's arrays, a BLAKE2b
checksum or keyed MAC) and the reader that checks container, version, signature, checksum and content
before any tensor reaches an engine. Spec: docs/SNAPSHOTS.md (the snapshot file).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np

from engine_service.api.content import content_digest
from engine_service.api.snapshot_files import (
    FORMAT,
    FORMAT_VERSION,
    LoadRefusal,
    SnapshotRefused,
    StateLayout,
    atomic_write,
)
from engine_service.cache.seq_state import SeqState, StateTensor
from engine_service.persistence.snapshot import SessionSnapshot
from engine_service.persistence.snapshot_key import MAC_ALGORITHM, SnapshotKey

_PERSON = b"forkline-snap-v1"
_FIELDS = (
    "format",
    "format_version",
    "fingerprint",
    "cache_kind",
    "geometry",
    "positions",
    "written",
    "content_digest",
    "extra",
    "checksum",
)
# safetensors dtype code -> (numpy dtype holding the raw bytes, MLX dtype); bfloat16 travels as uint16
_DTYPES: Mapping[str, tuple[np.dtype, mx.Dtype]] = MappingProxyType(
    {
        "F32": (np.dtype("<f4"), mx.float32),
        "F16": (np.dtype("<f2"), mx.float16),
        "BF16": (np.dtype("<u2"), mx.bfloat16),
        "I32": (np.dtype("<i4"), mx.int32),
        "I64": (np.dtype("<i8"), mx.int64),
    }
)
_CODES = {mlx: code for code, (_, mlx) in _DTYPES.items()}


# ------------------------------------------------------------------------------------------ writing


def write_snapshot(
    path: str | os.PathLike, snapshot: SessionSnapshot, *, key: SnapshotKey | None = None
) -> int:
    """Write ``snapshot`` to ``path`` atomically, signed with ``key`` when given; the file's size in
    bytes. Its arrays: evaluated, contiguous ``mx.array`` or :class:`StateTensor`."""
    parts = _container(snapshot, key)
    return atomic_write(Path(path), lambda f: _write_parts(f, parts))


def encode_snapshot(snapshot: SessionSnapshot, *, key: SnapshotKey | None = None) -> bytes:
    """The bytes :func:`write_snapshot` would write (no MLX op: any thread)."""
    buffer = io.BytesIO()
    _write_parts(buffer, _container(snapshot, key))
    return buffer.getvalue()


def _write_parts(f: Any, parts: list[Any]) -> None:
    for part in parts:
        f.write(part)


def _container(snapshot: SessionSnapshot, key: SnapshotKey | None) -> list[Any]:
    tensors = {"content": ("I32", (snapshot.positions,), np.asarray(snapshot.content, dtype="<i4"))}
    for name, array in snapshot.state.arrays.items():
        if name == "content":
            raise ValueError("a snapshot array may not be named 'content'")
        if isinstance(array, StateTensor):
            tensors[name] = (_code(array.dtype), tuple(array.shape), array.data)
        elif isinstance(array, mx.array):
            tensors[name] = (_code(array.dtype), tuple(array.shape), memoryview(array))
        else:
            raise ValueError(f"snapshot array {name!r} must be an mx.array or a StateTensor")
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "fingerprint": snapshot.fingerprint,
        "cache_kind": snapshot.layout.cache_kind,
        "geometry": snapshot.layout.geometry,
        "positions": str(snapshot.positions),
        "written": str(snapshot.state.written),
        "content_digest": snapshot.content_digest.hex(),
        "extra": json.dumps(dict(snapshot.extra), sort_keys=True),
    }
    if key is not None:
        metadata["mac"] = MAC_ALGORITHM
    metadata["checksum"] = _checksum(metadata, ((n, *tensors[n]) for n in sorted(tensors)), key)
    return _safetensors_parts(tensors, metadata)


def _safetensors_parts(
    tensors: Mapping[str, tuple[str, tuple[int, ...], Any]], metadata: dict[str, str]
) -> list[Any]:
    # u64 little-endian header length, the JSON header, then the tensors' bytes in name order
    header: dict[str, Any] = {"__metadata__": metadata}
    at, data = 0, []
    for name in sorted(tensors):
        code, shape, raw = tensors[name]
        size = memoryview(raw).nbytes
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
        data.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned
    return [struct.pack("<Q", len(text)), text, *data]


def _checksum(
    metadata: Mapping[str, str],
    tensors: Iterator[tuple[str, str, tuple[int, ...], Any]],
    key: SnapshotKey | None = None,
) -> str:
    """Hex BLAKE2b-256 of the sorted-JSON metadata, then ``name:dtype:shape;`` and the BLAKE2b-256 of
    each tensor's bytes in name order; keyed with ``key`` it is a MAC over every byte."""
    items = list(tensors)
    with ThreadPoolExecutor(max_workers=_workers(len(items))) as pool:
        digests = list(pool.map(_digest, (data for _, _, _, data in items)))  # hashlib drops the GIL
    h = hashlib.blake2b(digest_size=32, person=_PERSON) if key is None else key.hasher(_PERSON)
    h.update(json.dumps({k: v for k, v in metadata.items() if k != "checksum"}, sort_keys=True).encode())
    for (name, code, shape, _), digest in zip(items, digests, strict=True):
        h.update(f"{name}:{code}:{list(shape)};".encode())
        h.update(digest)
    return h.hexdigest()


def _digest(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=32, person=_PERSON).digest()


def _workers(n: int) -> int:
    return max(1, min(n, os.cpu_count() or 1, 8))


# ------------------------------------------------------------------------------------------ reading


def read_snapshot(path: str | os.PathLike, *, key: SnapshotKey | None = None) -> SessionSnapshot:
    """The snapshot in ``path``, or SnapshotRefused (UNREADABLE, FORMAT_VERSION, UNSIGNED /
    BAD_SIGNATURE, CHECKSUM, CONTENT, checked in that order); ``key``: this engine's."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SnapshotRefused(LoadRefusal.UNREADABLE, f"{path}: {exc.strerror or exc}") from None
    return decode_snapshot(data, str(path), key=key)


def decode_snapshot(
    data: bytes, source: str = "snapshot", *, key: SnapshotKey | None = None
) -> SessionSnapshot:
    path = source
    metadata, tensors = _parse(path, data)
    fmt, version = metadata.get("format"), metadata.get("format_version")
    if fmt != FORMAT or version != str(FORMAT_VERSION):
        raise SnapshotRefused(
            LoadRefusal.FORMAT_VERSION,
            f"{path}: format {fmt!r} version {version!r}, this engine reads {FORMAT!r} "
            f"version {FORMAT_VERSION}",
        )
    missing = [name for name in _FIELDS if name not in metadata]
    if missing or "content" not in tensors:
        raise SnapshotRefused(LoadRefusal.UNREADABLE, f"{path}: missing {missing or ['content tensor']}")
    signed = _signature_rule(path, metadata, key)
    want = _checksum(
        metadata,
        ((n, _code(t.dtype), t.shape, t.data) for n, t in sorted(tensors.items())),
        key if signed else None,
    )
    if not hmac.compare_digest(metadata["checksum"].encode(), want.encode()):
        if signed:  # a forgery, another key's file or damage: the right MAC is never shown
            raise SnapshotRefused(
                LoadRefusal.BAD_SIGNATURE, f"{path}: its MAC does not match its bytes under this engine's key"
            )
        raise SnapshotRefused(
            LoadRefusal.CHECKSUM,
            f"{path}: checksum {metadata['checksum'][:16]}... does not match its bytes ({want[:16]}...)",
        )
    try:  # the checksum vouches for the writer; a writer's bug still must not reach the engine
        positions, written = int(metadata["positions"]), int(metadata["written"])
        extra = json.loads(metadata["extra"])
        content = tensors.pop("content")
        ids = tuple(content.data.tolist())
        state = SeqState(positions, written, _to_mlx(tensors))
    except (ValueError, TypeError) as exc:
        raise SnapshotRefused(LoadRefusal.UNREADABLE, f"{path}: {exc}") from None
    if content.dtype != mx.int32 or len(ids) != positions:
        raise SnapshotRefused(
            LoadRefusal.CONTENT, f"{path}: content of {len(ids)} ids for {positions} positions"
        )
    if any(t < 0 for t in ids) or content_digest(ids).hex() != metadata["content_digest"]:
        raise SnapshotRefused(LoadRefusal.CONTENT, f"{path}: content does not match its digest")
    if not isinstance(extra, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in extra.items()
    ):
        raise SnapshotRefused(LoadRefusal.UNREADABLE, f"{path}: extra must be a JSON object of strings")
    layout = StateLayout(metadata["cache_kind"], metadata["geometry"])
    return SessionSnapshot(metadata["fingerprint"], layout, state, ids, MappingProxyType(extra))


def _signature_rule(path: str, metadata: Mapping[str, str], key: SnapshotKey | None) -> bool:
    """Whether the checksum is a MAC to verify with ``key``; UNSIGNED / BAD_SIGNATURE when the file and
    the engine disagree about signing."""
    mac = metadata.get("mac")
    if mac is None:
        if key is not None:
            raise SnapshotRefused(
                LoadRefusal.UNSIGNED,
                f"{path}: the file is not signed, and this engine loads only files signed with its "
                f"--snapshot_key",
            )
        return False
    if mac != MAC_ALGORITHM:
        raise SnapshotRefused(
            LoadRefusal.BAD_SIGNATURE,
            f"{path}: MAC algorithm {mac[:40]!r}, this engine verifies {MAC_ALGORITHM!r}",
        )
    if key is None:
        raise SnapshotRefused(
            LoadRefusal.BAD_SIGNATURE,
            f"{path}: the file is signed (a keyed MAC) and this engine has no --snapshot_key to verify it",
        )
    return True


def _code(dtype: mx.Dtype) -> str:
    return _CODES[dtype]


def _to_mlx(tensors: Mapping[str, StateTensor]) -> dict[str, mx.array]:
    names = sorted(tensors)
    with ThreadPoolExecutor(max_workers=_workers(len(names))) as pool:
        raw = list(pool.map(lambda name: tensors[name].copy_raw(), names))
    arrays = {name: tensors[name].to_mlx(a) for name, a in zip(names, raw, strict=True)}
    mx.eval(list(arrays.values()))
    return arrays


def _parse(path: Any, data: bytes) -> tuple[dict[str, str], dict[str, StateTensor]]:
    """(metadata, tensors); UNREADABLE unless the tensors' offsets tile the data exactly."""

    def bad(problem: str) -> SnapshotRefused:
        return SnapshotRefused(LoadRefusal.UNREADABLE, f"{path}: {problem}")

    if len(data) < 8:
        raise bad(f"{len(data)} bytes is too short for a safetensors file")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8:
        raise bad(f"header of {size} bytes but the file has {len(data) - 8} after its length")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not an object of strings")
    body = memoryview(data)[8 + size :]
    tensors, spans = {}, []
    for name, info in header.items():
        try:
            code, shape, (lo, hi) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            dtype, mlx_dtype = _DTYPES[code]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed or unsupported entry {info!r}") from None
        if (
            not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= len(body))
            or any(d < 0 for d in shape)
            or hi - lo != math.prod(shape) * dtype.itemsize
        ):
            raise bad(f"tensor {name!r} has data offsets {[lo, hi]} that do not fit its shape or the file")
        tensors[name] = StateTensor(shape, mlx_dtype, np.frombuffer(body[lo:hi], dtype=dtype))
        spans.append((lo, hi))
    at = 0
    for lo, hi in sorted(spans):  # the tensors must tile the data: no gap, no overlap, no tail
        if lo != at:
            raise bad(f"tensor data does not tile the file (a gap or overlap at byte {at})")
        at = hi
    if at != len(body):
        raise bad(f"{len(body) - at} bytes after the last tensor (or the file was cut)")
    return metadata, tensors
