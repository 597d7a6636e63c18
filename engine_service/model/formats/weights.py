"""Weight tensors as loaders hand them over (canonical names -> float ``mx.array`` or :class:`QuantTensor`,
MLX affine: uint32 ``weight`` [out, in * bits / 32], ``scales`` / ``biases`` [out, in / group_size]),
and the weights-dtype policy."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx

from engine_service.api.errors import InvalidArgument, ModelLoadError
from engine_service.model.cpu_kernels import kernel_status

log = logging.getLogger(__name__)

# q8_0 / q4_1: block formats for the compiled CPU kernels (engine_service/model/formats/block_quant.py)
WEIGHTS_DTYPES = ("auto", "float32", "float16", "bfloat16", "quantized", "q8_0", "q4_1")
# what auto picks on the CPU when the compiled kernels load: every matrix keeps its source's block
# format where that is exact (q4_1 for 4-bit sources, q8_0 for 8-/5-bit symmetric ones) and q8_0
# otherwise (engine_service.model.layers.convert)
CPU_KERNEL_DTYPE = "native"
_FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Quantization used when "quantized" is asked for a float matrix (tiny models, float folders).
DEFAULT_GROUP_SIZE = 32
DEFAULT_BITS = 4


@dataclass(frozen=True)
class QuantTensor:
    """An MLX affine-quantized matrix; ``shape`` is the logical (dequantized) [out, in] shape."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        if self.weight.dtype != mx.uint32 or self.weight.ndim != 2:
            raise InvalidArgument(
                f"QuantTensor.weight must be a 2-D uint32 array, got {self.weight.dtype} {self.weight.shape}"
            )
        if self.scales.shape != self.biases.shape or self.scales.shape[0] != self.weight.shape[0]:
            raise InvalidArgument(
                f"QuantTensor.scales/biases shapes {self.scales.shape}/{self.biases.shape} do not match weight {self.weight.shape}"
            )
        if (
            self.bits not in (2, 3, 4, 5, 6, 8)
            or self.weight.shape[1] * 32 != self.scales.shape[1] * self.group_size * self.bits
        ):
            raise InvalidArgument(
                f"QuantTensor: weight {self.weight.shape} with {self.bits} bits does not match "
                f"{self.scales.shape[1]} groups of {self.group_size}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.scales.shape[1] * self.group_size)

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        w = mx.dequantize(
            self.weight,
            self.scales.astype(mx.float32),
            self.biases.astype(mx.float32),
            self.group_size,
            self.bits,
        )
        return w.astype(dtype)

    def rows(self, ids: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Dequantized rows ``ids`` (an embedding lookup): [len(ids), in]."""
        return mx.dequantize(
            self.weight[ids], self.scales[ids], self.biases[ids], self.group_size, self.bits
        ).astype(dtype)

    def with_scale_dtype(self, dtype: mx.Dtype) -> QuantTensor:
        return QuantTensor(
            self.weight, self.scales.astype(dtype), self.biases.astype(dtype), self.group_size, self.bits
        )


def quant_from_arrays(
    weight: mx.array, scales: mx.array, biases: mx.array, group_size: int | None = None
) -> QuantTensor:
    """Infer ``bits`` from the packed width; ``group_size`` defaults to 32 (GGUF's block size)."""
    group = group_size or DEFAULT_GROUP_SIZE
    in_features = scales.shape[-1] * group
    bits, rem = divmod(weight.shape[-1] * 32, in_features)
    if rem:
        raise InvalidArgument(f"quantized tensor {weight.shape} does not pack {in_features} inputs")
    return QuantTensor(weight, scales, biases, group, bits)


def named_tensor(
    path: str, raw: dict[str, mx.array], name: str, group_size: int | None, optional: bool = False
) -> mx.array | QuantTensor | None:
    """``raw[name + ".weight"]`` (a QuantTensor with ``.scales`` / ``.biases``); ModelLoadError when
    missing (None when ``optional``)."""
    weight = raw.get(name + ".weight")
    if weight is None:
        if optional:
            return None
        raise ModelLoadError(path, f"tensor {name}.weight is missing")
    scales, biases = raw.get(name + ".scales"), raw.get(name + ".biases")
    if weight.dtype != mx.uint32 and scales is None:
        return weight
    if scales is None or biases is None:
        raise ModelLoadError(path, f"quantized tensor {name} has no scales/biases")
    try:
        return quant_from_arrays(weight, scales, biases, group_size)
    except ValueError as exc:
        raise ModelLoadError(path, f"quantized tensor {name}: {exc}") from None


def gpu_available() -> bool:
    """Whether MLX runs on an accelerator here (Metal or CUDA)."""
    try:
        if mx.default_device() == mx.gpu:
            return True
    except Exception:  # noqa: BLE001 - a device query failing only means "no GPU"
        return False
    for backend in ("metal", "cuda"):
        mod = getattr(mx, backend, None)
        try:
            if mod is not None and mod.is_available():
                return True
        except Exception:  # noqa: BLE001
            continue
    return False


def resolve_weights_dtype(weights_dtype: str) -> str:
    """``auto`` -> ``quantized`` on a GPU, ``native`` on the CPU with the kernels, else ``float32``
    (MLX's CPU quantized matmuls are 5-50x slower than OpenBLAS); anything else validated."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise InvalidArgument(
            f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, got {weights_dtype!r}"
        )
    if weights_dtype != "auto":
        return weights_dtype
    if gpu_available():
        return "quantized"
    status = kernel_status()
    if status.available:
        return CPU_KERNEL_DTYPE
    log.warning("weights_dtype auto: float32 on the CPU, %s", status.describe())
    return "float32"


def convert_matrix(tensor: mx.array | QuantTensor, weights_dtype: str) -> mx.array | QuantTensor:
    """A matrix in the resolved ``weights_dtype``: dequantize, cast, or quantize (4-bit, group 32)."""
    if weights_dtype == "quantized":
        if isinstance(tensor, QuantTensor):
            # Scales in float32 keep MLX's CPU quantized matmul on its float32 path (activations are f32).
            return tensor.with_scale_dtype(mx.float32) if not gpu_available() else tensor
        if tensor.shape[-1] % DEFAULT_GROUP_SIZE:
            return tensor.astype(mx.float32)
        w, s, b = mx.quantize(tensor.astype(mx.float32), group_size=DEFAULT_GROUP_SIZE, bits=DEFAULT_BITS)
        return QuantTensor(w, s, b, DEFAULT_GROUP_SIZE, DEFAULT_BITS)
    dtype = _FLOAT_DTYPES[weights_dtype]
    if isinstance(tensor, QuantTensor):
        return tensor.dequantize(dtype)
    return tensor.astype(dtype)


def concat_rows(parts: list[mx.array | QuantTensor]) -> mx.array | QuantTensor:
    """Matrices stacked along the output (fused q/k/v, gate/up); quantized parts of one format row-wise."""
    if all(isinstance(p, QuantTensor) for p in parts):
        first = parts[0]
        if all(p.group_size == first.group_size and p.bits == first.bits for p in parts):
            return QuantTensor(
                mx.concatenate([p.weight for p in parts]),
                mx.concatenate([p.scales for p in parts]),
                mx.concatenate([p.biases for p in parts]),
                first.group_size,
                first.bits,
            )
    floats = [p.dequantize() if isinstance(p, QuantTensor) else p for p in parts]
    dtype = floats[0].dtype
    return mx.concatenate([f.astype(dtype) for f in floats])
