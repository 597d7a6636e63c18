"""Negative controls: each layout convention is visible in the logits (Gemma norms stored the other
way, Phi-3's gate/up halves swapped, Q/K permuted like llama), and the hand-written config is not a
naive guess."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.cache.config import FULL, SLIDING
from engine_service.model import load_model
from tests.model import naive_reference
from tests.model.arch_files.gguf_layout import to_gguf, write_and_load
from tests.model.arch_files.hf_layout import hf_expected, write_folder
from tests.model.arch_files.tiny_archs import HIDDEN, INTER, SPECS, TOKENS, expected_config, gap, logits


def test_gemma3_norms_stored_as_w_differ(tmp_path, models, gguf_files):
    """A Gemma 3 GGUF whose norms hold ``w`` instead of the converter's ``1 + w`` loads (nothing in a file
    says which) but computes another model: the float32 comparison above would catch a wrong offset."""
    spec = SPECS["gemma3"]
    raw, _ = to_gguf(spec, models["gemma3"], gemma_norm_offset=-1.0)
    loaded = write_and_load(tmp_path, spec, raw)
    assert gap(logits(loaded.model), gguf_files["gemma3"][2]) > 0.3


def test_phi3_gate_up_halves_swapped_differ(tmp_path, models, gguf_files):
    spec = SPECS["phi3"]
    swapped = dict(models["phi3"])
    for i in range(spec.layers):
        w = swapped[f"layers.{i}.gate_up"]
        swapped[f"layers.{i}.gate_up"] = np.concatenate([w[INTER:], w[:INTER]])
    raw, _ = to_gguf(spec, swapped)
    loaded = write_and_load(tmp_path, spec, raw)
    assert gap(logits(loaded.model), gguf_files["phi3"][2]) > 0.3


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_qk_permuted_like_llama_differs(tmp_path, models, gguf_files, arch):
    """Only llama's Q/K rows are permuted by the converter; reading another architecture's rows as if they
    were would be wrong, and visible."""
    spec = SPECS[arch]
    raw, _ = to_gguf(spec, models[arch], permute=True)
    loaded = write_and_load(tmp_path, spec, raw)
    assert gap(logits(loaded.model), gguf_files[arch][2]) > 0.3


def test_gemma3_folder_norms_stored_as_multipliers_differ(tmp_path, models):
    """A Gemma folder holding ``1 + w`` (the GGUF convention) gets 1 added again: visibly another model."""
    spec = SPECS["gemma3"]
    loaded = load_model(write_folder(tmp_path / "g", spec, models["gemma3"], norm_offset=0.0), "float32")
    want = naive_reference.forward(hf_expected(spec), models["gemma3"], TOKENS)
    assert gap(logits(loaded.model), want) > 0.3


def test_expected_config_helper_is_not_the_engines():
    """The hand-written config differs from a naive guess where the architectures differ (sanity of the
    test itself: gemma3's sixth layer is global, phi3 slides everywhere, qwen3's head_dim is its own)."""
    g = expected_config(SPECS["gemma3"])
    assert [s.kind for s in g.layers] == [SLIDING] * 5 + [FULL]
    assert all(s.kind == SLIDING for s in expected_config(SPECS["phi3"]).layers)
    assert expected_config(SPECS["qwen3"]).q_size == 192 != HIDDEN
