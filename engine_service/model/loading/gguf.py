"""GGUF model files -> the architecture's config and canonical tensors: float tensors as float32, exact
32-weight block types as BlockQuantTensor (lossless), the rest decoded for ``weights_dtype``; a tensor
the architecture does not read refuses the file. Spec: docs/MODELS.md (GGUF tensor types)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

import engine_service.model.arch as registry
from engine_service.api.errors import InvalidArgument, ModelLoadError
from engine_service.model.arch.base import GGUF
from engine_service.model.config import ModelConfig
from engine_service.model.formats.block_quant import BLOCK, BlockQuantTensor
from engine_service.model.formats.ggml_blocks import Blocks32, dequantize, exact_blocks32
from engine_service.model.loading.gguf_file import GGUFFile, TensorRecord

Tensor = mx.array | BlockQuantTensor


def read_metadata(path: str) -> dict[str, Any]:
    """The metadata of a validated GGUF file."""
    with GGUFFile(path) as f:
        return dict(f.metadata)


def gguf_config(path: str, meta: dict[str, Any]) -> ModelConfig:
    return registry.for_gguf(meta.get("general.architecture"), path).config_from_gguf(meta, path)


def block_tensor(blocks: Blocks32, cols: int) -> BlockQuantTensor:
    """A kernel-format matrix of an exact 32-weight block form (q int8 -> q8_0, q in [0, 15] -> q4_1)."""
    rows = blocks.q.shape[0]
    if blocks.mins is None:
        return BlockQuantTensor(
            "q8_0", mx.array(blocks.q.astype(np.int8)), mx.array(blocks.scales), None, cols
        )
    q = blocks.q.astype(np.uint8).reshape(rows, -1, BLOCK)
    packed = (q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)).reshape(rows, -1)
    return BlockQuantTensor("q4_1", mx.array(packed), mx.array(blocks.scales), mx.array(blocks.mins), cols)


def decode_tensor(f: GGUFFile, rec: TensorRecord, shape: tuple[int, ...]) -> Tensor:
    """One tensor as the model wants it: ``shape`` is the canonical [out, in] or [n]."""
    rows, cols = rec.rows_cols
    data = f.tensor_bytes(rec.name)
    try:
        if len(shape) == 2:
            exact = exact_blocks32(rec.block, data, rows, cols)
            if exact is not None:
                return block_tensor(exact, cols)
        values = dequantize(rec.block, data, rows, cols)
    except InvalidArgument as exc:
        raise ModelLoadError(f.path, f"tensor {rec.name}: {exc}") from None
    return mx.array(values.reshape(shape) if len(shape) == 1 else values)


def gguf_tensors(f: GGUFFile, config: ModelConfig) -> dict[str, Tensor]:
    """Canonical names from the file's names."""
    arch = registry.architecture(config.architecture)
    names, shapes = arch.tensor_names(config, GGUF), arch.shapes(config)
    out: dict[str, Tensor] = {}
    used = set()
    for canon, name in names.items():
        rec = f.tensors.get(name)
        if rec is None:
            if canon == "lm_head":
                continue
            raise ModelLoadError(f.path, f"tensor {name} is missing")
        want = shapes[canon]
        got = tuple(reversed(rec.shape))
        if got != want:
            raise ModelLoadError(f.path, f"tensor {name} has shape {got}, expected {want}")
        out[canon] = decode_tensor(f, rec, want)
        used.add(name)
    extra = [n for n in f.tensors if n not in used]
    if extra:
        raise ModelLoadError(
            f.path,
            f"tensor {extra[0]} is not read by architecture {config.architecture!r} "
            f"({len(extra)} such tensors); running without it would compute another model",
        )
    return out


def load_gguf(path: str) -> tuple[ModelConfig, dict[str, Tensor], dict[str, Any]]:
    """(config, canonical tensors, metadata) of a GGUF file of any registered architecture."""
    with GGUFFile(path) as f:
        meta = dict(f.metadata)
        config = gguf_config(path, meta)
        if "output.weight" in f.tensors:
            config = replace(config, tie_embeddings=False)
        tensors = gguf_tensors(f, config)  # mx.array copies out of the memory map
    return config, tensors, meta
