"""A bounds-checked walk over a GGUF file's header before MLX reads it.

``mx.load`` reports most truncations as a RuntimeError but crashes the process (SIGSEGV) on some
garbage headers, so every GGUF is checked here first: magic, version, every metadata value and tensor
record inside the file, tensor types MLX can load, and every tensor's data inside the file.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (read for the layout; no code copied).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

from engine_service.errors import ModelLoadError

# ggml tensor type -> (name, elements per block, bytes per block); only the types MLX's loader reads.
TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
}
# metadata value type -> struct format of a scalar (8 = string, 9 = array handled apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24  # sanity bound on tensor / key / array counts


@dataclass(frozen=True)
class TensorRecord:
    name: str
    shape: tuple[int, ...]  # ggml order: innermost dimension first
    type_name: str
    offset: int
    nbytes: int


class _Reader:
    def __init__(self, path: str, buf: mmap.mmap) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def fail(self, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, f"corrupt or truncated GGUF: {problem}")

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise self.fail(f"header ends early at byte {self.pos} (file is {len(self.buf)} bytes)")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise self.fail(f"a string of {n} bytes at byte {self.pos} runs past the end of the file")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_value(self, vtype: int, depth: int = 0) -> object:
        """Skip one metadata value; return it when it is a scalar or string (used for alignment)."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY and depth < 2:
            etype, count = self.take("I"), self.take("Q")
            if count > _MAX_COUNT:
                raise self.fail(f"array of {count} elements")
            if etype in _SCALARS:
                size = struct.calcsize("<" + _SCALARS[etype]) * count
                if self.pos + size > len(self.buf):
                    raise self.fail("an array runs past the end of the file")
                self.pos += size
            else:
                for _ in range(count):
                    self.skip_value(etype, depth + 1)
            return None
        raise self.fail(f"unknown metadata value type {vtype}")


def check_gguf(path: str) -> list[TensorRecord]:
    """Validate ``path`` as a GGUF MLX can load; return its tensor records. Raises ModelLoadError."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(
                    path, "not a GGUF file (bad magic; expected a .gguf file or an MLX model folder)"
                )
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Reader(path, buf))
    except OSError as exc:
        raise ModelLoadError(path, f"cannot read: {exc.strerror or exc}") from None


def _walk(r: _Reader) -> list[TensorRecord]:
    r.pos = 4
    version = r.take("I")
    if version not in (2, 3):
        raise ModelLoadError(r.path, f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    if n_tensors > _MAX_COUNT or n_kv > _MAX_COUNT:
        raise r.fail(f"implausible counts ({n_tensors} tensors, {n_kv} metadata keys)")
    alignment = 32
    for _ in range(n_kv):
        key = r.string()
        value = r.skip_value(r.take("I"))
        if key == "general.alignment" and isinstance(value, int) and value > 0:
            alignment = value
    records = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.take("I")
        if not 1 <= n_dims <= 4:
            raise r.fail(f"tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.take("Q") for _ in range(n_dims))
        ttype, offset = r.take("I"), r.take("Q")
        if ttype not in TENSOR_TYPES:
            supported = ", ".join(t[0] for t in TENSOR_TYPES.values())
            raise ModelLoadError(
                r.path,
                f"tensor {name!r} has ggml type {ttype}, which MLX cannot load (supported: {supported})",
            )
        tname, block, block_bytes = TENSOR_TYPES[ttype]
        count = 1
        for d in shape:
            count *= d
        if count % block:
            raise r.fail(f"tensor {name!r} size {count} is not a multiple of its {tname} block")
        records.append(TensorRecord(name, shape, tname, offset, count // block * block_bytes))
    data_start = -(-r.pos // alignment) * alignment
    for rec in records:
        end = data_start + rec.offset + rec.nbytes
        if end > len(r.buf):
            raise r.fail(
                f"tensor {rec.name!r} ends at byte {end}, past the end of the file ({len(r.buf)} bytes)"
            )
    return records
