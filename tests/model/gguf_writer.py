"""A minimal GGUF v3 writer for tests (F32/F16/Q4_0/Q8_0 tensors, scalar/string/array metadata).

Independent of the loader: it follows the published layout (header, metadata, tensor infos with ggml
dimension order innermost first, 32-byte aligned data).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_U32, _I32, _F32, _BOOL, _STR, _ARR = 4, 5, 6, 7, 8, 9


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(v) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", _BOOL, v)
    if isinstance(v, int):
        return struct.pack("<II", _U32, v)
    if isinstance(v, float):
        return struct.pack("<If", _F32, v)
    if isinstance(v, str):
        return struct.pack("<I", _STR) + _string(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", _ARR, _STR, len(v)) + b"".join(_string(x) for x in v)
        if v and all(isinstance(x, float) for x in v):
            return struct.pack("<IIQ", _ARR, _F32, len(v)) + struct.pack(f"<{len(v)}f", *v)
        return struct.pack("<IIQ", _ARR, _I32, len(v)) + struct.pack(f"<{len(v)}i", *v)
    raise TypeError(type(v))


@dataclass(frozen=True)
class BlockQuant:
    """A ggml block-quantized matrix: raw blocks plus the values they decode to (numpy, float32)."""

    ggml_type: int
    shape: tuple[int, ...]
    blocks: bytes
    dequantized: np.ndarray


def quantize_q8_0(w: np.ndarray) -> BlockQuant:
    """Blocks of 32: float16 scale d = amax / 127, then 32 int8 q; value = q * d."""
    b = w.astype(np.float32).reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    q = np.where(df > 0, np.round(b / np.where(df > 0, df, 1)), 0).clip(-127, 127).astype(np.int8)
    blocks = b"".join(d[i].tobytes() + q[i].tobytes() for i in range(len(b)))
    return BlockQuant(8, w.shape, blocks, (q * df).reshape(w.shape).astype(np.float32))


def quantize_q4_0(w: np.ndarray) -> BlockQuant:
    """Blocks of 32: float16 scale d = (signed value of largest magnitude) / -8, then 16 bytes where
    byte j holds q[j] in the low nibble and q[j + 16] in the high one; value = (q - 8) * d."""
    b = w.astype(np.float32).reshape(-1, 32)
    idx = np.abs(b).argmax(axis=1)
    d = (b[np.arange(len(b)), idx] / -8.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    q = np.where(df != 0, np.round(b / np.where(df != 0, df, 1) + 8), 8).clip(0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    blocks = b"".join(d[i].tobytes() + packed[i].tobytes() for i in range(len(b)))
    return BlockQuant(2, w.shape, blocks, ((q.astype(np.float32) - 8) * df).reshape(w.shape))


def write_gguf(path: str, metadata: dict, tensors: dict[str, np.ndarray | BlockQuant]) -> None:
    """tensors: name -> float32 / float16 numpy array or BlockQuant, row-major [out, in]."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    blobs, offset = [], 0
    for name, arr in tensors.items():
        if isinstance(arr, BlockQuant):
            ttype, shape, blob = arr.ggml_type, arr.shape, arr.blocks
        else:
            ttype = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}[arr.dtype]
            shape, blob = arr.shape, np.ascontiguousarray(arr).tobytes()
        out += (
            _string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *reversed(shape))
        )
        out += struct.pack("<IQ", ttype, offset)
        blob += b"\0" * (-len(blob) % 32)
        blobs.append(blob)
        offset += len(blob)
    out += b"\0" * (-len(out) % 32)
    with open(path, "wb") as f:
        f.write(bytes(out))
        for blob in blobs:
            f.write(blob)


def permute_for_gguf(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of Hugging Face Q/K rows: within each head, interleave the two rotary
    halves (row i and row i + D/2 become neighbours)."""
    out, d_in = w.shape
    d = out // heads
    return w.reshape(heads, 2, d // 2, d_in).transpose(0, 2, 1, 3).reshape(out, d_in)


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """128 byte-level tokens: 3 specials, printable ASCII, then "Ġx" pieces with their merges."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    pieces = ["Ġ" + chr(c) for c in range(97, 97 + 128 - len(specials) - len(chars))]
    tokens = specials + chars + pieces
    merges = [f"Ġ {p[1]}" for p in pieces]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, merges, types
