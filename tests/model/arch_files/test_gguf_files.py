"""Qwen2, Qwen3, Phi-3 and Gemma 3 (Llama as the control) from GGUF files the tests write in llama.cpp's
layout (tests/model/arch_files/gguf_layout.py), against the naive float64 forward; no real file of these
architectures ships in a package.

``float32`` loading must equal the reference on the values the blocks stand for (the writer's own
dequantization) up to float32 rounding; ``auto`` keeps every exact format (Q5_0/Q8_0 -> q8_0; Q4_0, Q4_1,
Q4_K -> q4_1) and requantizes only Q6_K to q8_0: it equals the reference on the values the model holds,
and the requantization's own loss is measured and bounded. Phi-3's 4k files load, LongRoPE ones are refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.api.errors import ModelLoadError
from engine_service.model import load_model
from engine_service.model.projections import SplitProjection
from tests.model import naive_reference
from tests.model.arch_files.gguf_layout import gguf_metadata, gguf_name, to_gguf, write_and_load
from tests.model.arch_files.hf_layout import hf_name
from tests.model.arch_files.tiny_archs import (
    ARCHS,
    ATOL,
    EPS,
    QUANT,
    SPECS,
    TOKENS,
    expect_error,
    expected_config,
    gap,
    logits,
    role,
    shapes,
)
from tests.model.gguf_writer import write_gguf


def test_the_layouts_are_llama_cpps():
    """The test's GGUF names are in gguf-py's tensor list of each architecture, and its Hugging Face names
    map to them through gguf-py's TensorNameMap (what convert_hf_to_gguf.py renames by)."""
    gguf = pytest.importorskip("gguf")
    for arch in ARCHS:
        spec = SPECS[arch]
        arch_id = gguf.MODEL_ARCH[arch.upper()]
        known = {gguf.TENSOR_NAMES[t].format(bid=i) for t in gguf.MODEL_TENSORS[arch_id] for i in range(6)}
        mapping = gguf.get_tensor_name_map(arch_id, spec.layers)
        for canon in shapes(spec):
            name = gguf_name(canon)
            assert name.rsplit(".", 1)[0] in known, (arch, name)
            hf = hf_name(spec, canon)
            assert mapping.get_name(hf, try_suffixes=(".weight", ".bias")) == name, (arch, hf)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_float32_matches_the_naive_forward(arch, gguf_files):
    spec = SPECS[arch]
    path, _values, want = gguf_files[arch]
    loaded = load_model(path, "float32")
    # llama's rows are stored permuted: traditional RoPE on them; every other architecture: unpermuted
    eps = float(np.float32(EPS))  # GGUF stores the epsilon as float32
    assert loaded.config == expected_config(spec, eps, rope_traditional=arch == "llama")
    assert loaded.weights_dtype == "float32"
    got = logits(loaded.model)
    assert gap(got, want) < ATOL, gap(got, want)
    assert np.abs(want).max() > 1.0  # the logits are O(1): ATOL is a relative bound too


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_auto_keeps_block_formats(arch, gguf_files, models):
    """``auto`` (CPU kernels): Q5_0 / Q8_0 -> q8_0, Q4_0 / Q4_1 / Q4_K -> q4_1 without loss; Q6_K (down and
    an untied head) is requantized to q8_0. The model equals the reference on the values it holds (ATOL),
    and the requantization's loss is bounded by Q6_K's own: q8_0's half step is amax / 254 over 32
    weights, Q6_K's about amax / 62 over 16, so requantizing adds at most ~1/4 of the error Q6_K itself
    made. Measured over seeds 3-6, every architecture: max |logit gap| 0.016-0.032 (logits up to 3-7,
    i.e. ~1% of the logit scale, well above the 1e-3 a lossless path would give), 0.22-0.34 of Q6_K's
    own gap (0.06-0.13); bound: half of it."""
    from engine_service.model.cpu_kernels import kernel_status
    from engine_service.model.formats.weights import gpu_available

    if gpu_available() or not kernel_status().available:
        pytest.skip("auto keeps block formats only on the CPU with the compiled kernels")
    spec = SPECS[arch]
    path, values, want = gguf_files[arch]
    loaded = load_model(path, "auto")
    assert loaded.weights_dtype == "q4_1+q8_0"
    model = loaded.model
    layer = model.layers[0]
    if arch == "phi3":  # one stored tensor each: one kernel format each
        assert (layer.qkv.format, layer.gate_up.format) == ("q8_0", "q4_1")
    else:  # q, k q8_0 and v q4_1: split by format, v's part keeps its own bias
        assert isinstance(layer.qkv, SplitProjection) and layer.qkv.format == "q4_1+q8_0"
        assert layer.gate_up.format == "q4_1"
    assert (layer.o.format, layer.down.format, model.embed_tokens.format) == ("q4_1", "q8_0", "q8_0")
    held = dict(values)  # what the model holds: the file's values, Q6_K ones requantized
    for i, lay in enumerate(model.layers):
        held[f"layers.{i}.down"] = np.asarray(lay.down.tensor.dequantize())
    if not spec.tied:
        held["lm_head"] = np.asarray(model.lm_head.tensor.dequantize())
    got = logits(model)
    config = expected_config(spec)
    assert gap(got, naive_reference.forward(config, held, TOKENS)) < ATOL
    source = {k: models[arch][k] if QUANT.get(role(k)) == "Q6_K" else v for k, v in values.items()}
    q6_k_own = gap(want, naive_reference.forward(config, source, TOKENS))
    assert 1e-3 < gap(got, want) < 0.5 * q6_k_own, (gap(got, want), q6_k_own)


def test_phi3_gguf_as_llama_cpp_converts_the_4k_models_loads(tmp_path, models):
    """convert_hf_to_gguf.py's Phi3MiniModel writes ``phi3.rope.scaling.original_context_length``
    (original_max_position_embeddings, 4096) for every Phi-3, the 4k models included; LongRoPE files are
    the ones with ``rope_factors_long`` / ``rope_factors_short`` tensors and ``rope.scaling.attn_factor``."""
    spec = SPECS["phi3"]
    meta = gguf_metadata(spec)
    meta["phi3.rope.scaling.original_context_length"] = 4096
    raw, values = to_gguf(spec, models["phi3"], quantize=False)
    loaded = write_and_load(tmp_path, spec, raw, meta=meta)
    want = naive_reference.forward(expected_config(spec), values, TOKENS)
    assert gap(logits(loaded.model), want) < ATOL


def test_phi3_longrope_gguf_is_refused(tmp_path, models):
    """The 128k models: attn_factor in the metadata and rope_factors_* tensors; refused, not run wrong."""
    spec = SPECS["phi3"]
    meta = gguf_metadata(spec)
    meta["phi3.rope.scaling.attn_factor"] = 1.19
    meta["phi3.context_length"] = 131072
    raw, _ = to_gguf(spec, models["phi3"], quantize=False)
    raw["rope_factors_long.weight"] = np.ones(spec.d // 2, np.float32)
    raw["rope_factors_short.weight"] = np.ones(spec.d // 2, np.float32)
    path = str(tmp_path / "long.gguf")
    write_gguf(path, meta, raw)
    with pytest.raises(ModelLoadError, match="LongRoPE|rope_factors"):
        load_model(path, "float32")


def test_phi3_longrope_refusal_names_the_file(tmp_path, models):
    spec = SPECS["phi3"]
    meta = gguf_metadata(spec)
    meta["phi3.rope.scaling.attn_factor"] = 1.19
    raw, _ = to_gguf(spec, models["phi3"], quantize=False)
    path = str(tmp_path / "long.gguf")
    write_gguf(path, meta, raw)
    expect_error(path, "LongRoPE")
