"""A bounds-checked, memory-mapped GGUF reader (header, metadata, tensor records, each tensor's bytes):
every length, offset and type is checked, a damaged file is a ModelLoadError naming the problem.
Spec: docs/MODELS.md (GGUF tensor types); the format: ggml's GGUF spec (no code copied)."""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_service.api.errors import ModelLoadError
from engine_service.model.formats.ggml_blocks import BLOCK_TYPES, BlockType

# metadata value type -> struct format of a scalar (8 = string, 9 = array handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24  # sanity bound on tensor / key / array counts
_MAX_DIMS = 4


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's header entry: ``shape`` in ggml order (innermost first), ``offset`` absolute."""

    name: str
    shape: tuple[int, ...]
    block: BlockType
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.block.name

    @property
    def count(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def rows_cols(self) -> tuple[int, int]:
        """(rows, columns) of the tensor as a row-major matrix: ``cols`` = the innermost dimension."""
        cols = self.shape[0]
        return self.count // cols, cols


class _Reader:
    def __init__(self, path: str, buf: mmap.mmap) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def fail(self, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, f"corrupt or truncated GGUF: {problem}")

    def need(self, size: int, what: str) -> None:
        if size < 0 or self.pos + size > len(self.buf):
            raise self.fail(
                f"{what} at byte {self.pos} runs past the end of the file ({len(self.buf)} bytes)"
            )

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size, "the header")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value[0]

    def string(self) -> str:
        n = self.take("Q")
        self.need(n, f"a string of {n} bytes")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, depth: int = 0) -> Any:
        """One metadata value: a Python scalar, a str, or a list (numeric arrays via numpy)."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth == 0:
            etype, count = self.take("I"), self.take("Q")
            if count > _MAX_COUNT:
                raise self.fail(f"an array of {count} elements")
            if etype in _NUMPY:
                dtype = np.dtype(_NUMPY[etype])
                self.need(dtype.itemsize * count, f"an array of {count} elements")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += dtype.itemsize * count
                return arr.tolist()
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            raise self.fail(f"an array of metadata value type {etype}")
        raise self.fail(f"unknown metadata value type {vtype}")


class GGUFFile:
    """An open, validated GGUF file (a context manager): ``metadata`` key -> value, ``tensors`` name ->
    :class:`TensorRecord` in file order."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - kept open for the memory map's lifetime
        except OSError as exc:
            raise ModelLoadError(path, f"cannot read: {exc.strerror or exc}") from None
        try:
            if self._file.read(4) != b"GGUF":
                raise ModelLoadError(
                    path, "not a GGUF file (bad magic; expected a .gguf file or an MLX model folder)"
                )
            self._buf = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, self.tensors = _walk(_Reader(path, self._buf))
        except BaseException:
            self._file.close()
            raise

    def tensor_bytes(self, name: str) -> np.ndarray:
        """uint8 view [nbytes] of tensor ``name``'s data (valid while the file is open)."""
        rec = self.tensors.get(name)
        if rec is None:
            raise ModelLoadError(self.path, f"tensor {name} is missing")
        return np.frombuffer(self._buf, dtype=np.uint8, count=rec.nbytes, offset=rec.offset)

    def close(self) -> None:
        # numpy views may still point into the map; mmap refuses to close then, which is harmless
        with contextlib.suppress(BufferError, AttributeError):
            self._buf.close()
        self._file.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metadata(path: str) -> dict[str, Any]:
    """The metadata of a validated GGUF (tensors are checked too, not read)."""
    with GGUFFile(path) as f:
        return dict(f.metadata)


def _walk(r: _Reader) -> tuple[dict[str, Any], dict[str, TensorRecord]]:
    r.pos = 4
    version = r.take("I")
    if version not in (2, 3):
        raise ModelLoadError(r.path, f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
        raise r.fail(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.take("I"))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment <= 1 << 16:
        raise r.fail(f"general.alignment {alignment!r}")
    pending, seen = [], set()
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.take("I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.take("Q") for _ in range(n_dims))
        ttype, offset = r.take("I"), r.take("Q")
        block = BLOCK_TYPES.get(ttype)
        if block is None:
            supported = ", ".join(b.name for b in BLOCK_TYPES.values())
            raise ModelLoadError(
                r.path,
                f"tensor {name!r} has ggml type {ttype}, which forkline cannot decode (supported: {supported})",
            )
        if any(d < 1 for d in shape) or shape[0] % block.elements:
            raise r.fail(f"tensor {name!r} shape {shape} does not split into {block.name} blocks")
        count = 1
        for d in shape:
            count *= d
        if count > 1 << 40:
            raise r.fail(f"tensor {name!r} has {count} elements")
        if name in seen:
            raise r.fail(f"tensor {name!r} is listed twice")
        seen.add(name)
        pending.append((name, shape, block, offset, count // block.elements * block.nbytes))
    data_start = -(-r.pos // alignment) * alignment
    tensors: dict[str, TensorRecord] = {}
    for name, shape, block, offset, nbytes in pending:
        start = data_start + offset
        if offset % alignment:
            raise r.fail(f"tensor {name!r} data offset {offset} is not aligned to {alignment}")
        if start + nbytes > len(r.buf):
            raise r.fail(
                f"tensor {name!r} ends at byte {start + nbytes}, past the end of the file ({len(r.buf)} bytes)"
            )
        tensors[name] = TensorRecord(name, shape, block, start, nbytes)
    return metadata, tensors
