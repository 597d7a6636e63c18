"""Files the loader refuses, naming the tensor or the architecture: an unread tensor, a missing one, a
wrong shape, a folder without Qwen2's biases, an unknown architecture."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from tests.model.arch_files.gguf_layout import gguf_metadata, to_gguf
from tests.model.arch_files.hf_layout import write_folder
from tests.model.arch_files.tiny_archs import INTER, SPECS, expect_error
from tests.model.gguf_writer import write_gguf


def test_an_unread_tensor_refuses_the_file(tmp_path, models):
    """Llama 3's ``rope_freqs`` changes the RoPE frequencies: a file with it is not the model we'd run."""
    spec = SPECS["llama"]
    raw, _ = to_gguf(spec, models["llama"], quantize=False)
    raw["rope_freqs.weight"] = np.ones(spec.d // 2, np.float32)
    path = str(tmp_path / "extra.gguf")
    write_gguf(path, gguf_metadata(spec), raw)
    expect_error(path, r"tensor rope_freqs\.weight is not read by architecture 'llama' \(1 such tensors\)")


@pytest.mark.parametrize(
    "arch,drop",
    [
        ("qwen3", ["blk.1.attn_k_norm.weight"]),
        ("gemma3", ["blk.5.post_ffw_norm.weight"]),
        ("phi3", ["blk.0.attn_qkv.weight"]),
        ("qwen2", ["blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"]),  # qwen2 without biases
        ("qwen2", ["blk.1.attn_v.bias"]),
    ],
)
def test_a_missing_tensor_is_named(tmp_path, models, arch, drop):
    spec = SPECS[arch]
    raw, _ = to_gguf(spec, models[arch], quantize=False)
    for name in drop:
        del raw[name]
    path = str(tmp_path / "missing.gguf")
    write_gguf(path, gguf_metadata(spec), raw)
    expect_error(path, f"tensor {re.escape(drop[0])} is missing")


def test_a_wrong_shape_is_named(tmp_path, models):
    """Phi-3's ffn_up with only the up half (intermediate rows, not 2 * intermediate)."""
    spec = SPECS["phi3"]
    raw, _ = to_gguf(spec, models["phi3"], quantize=False)
    raw["blk.1.ffn_up.weight"] = raw["blk.1.ffn_up.weight"][INTER:]
    path = str(tmp_path / "shape.gguf")
    write_gguf(path, gguf_metadata(spec), raw)
    expect_error(path, r"tensor blk\.1\.ffn_up\.weight has shape \(512, 256\), expected \(1024, 256\)")


def test_folder_without_qwen2_biases_is_refused(tmp_path, models):
    spec = SPECS["qwen2"]
    folder = write_folder(
        tmp_path / "q", spec, models["qwen2"], drop={"model.layers.0.self_attn.k_proj.bias"}
    )
    expect_error(folder, r"tensor model\.layers\.0\.self_attn\.k_proj\.bias is missing")


def test_unknown_architecture_lists_the_supported_ones(tmp_path, models):
    spec = SPECS["llama"]
    raw, _ = to_gguf(spec, models["llama"], quantize=False)
    path = str(tmp_path / "mamba.gguf")
    write_gguf(path, gguf_metadata(spec, arch="mamba"), raw)
    expect_error(path, r"unsupported architecture 'mamba' \(supported: gemma3, llama, phi3, qwen2, qwen3\)$")
    folder = write_folder(tmp_path / "mamba", spec, models["llama"])
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**cfg, "model_type": "mamba"}, f)
    expect_error(
        folder,
        r"unsupported model_type 'mamba' \(supported: gemma3_text, llama, mistral, phi3, qwen2, qwen3\)$",
    )
