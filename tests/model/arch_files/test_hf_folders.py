"""Hugging Face folders of each architecture against the naive float64 forward, and Gemma 3 configs
written before ``layer_types`` existed."""

from __future__ import annotations

import json
import os

import pytest

from engine_service.model import load_model
from tests.model import naive_reference
from tests.model.arch_files.hf_layout import hf_expected, write_folder
from tests.model.arch_files.tiny_archs import ARCHS, ATOL, SPECS, TOKENS, gap, logits


@pytest.mark.parametrize("arch", ARCHS)
def test_folder_matches_the_naive_forward(arch, tmp_path, models):
    spec = SPECS[arch]
    loaded = load_model(write_folder(tmp_path / arch, spec, models[arch]), "float32")
    config = hf_expected(spec)
    assert loaded.config == config
    want = naive_reference.forward(config, models[arch], TOKENS)
    assert gap(logits(loaded.model), want) < ATOL, gap(logits(loaded.model), want)


@pytest.mark.parametrize("keys", ["sliding_window_pattern", "neither"])
def test_gemma3_folder_older_config_keys(tmp_path, models, keys):
    """Gemma 3 configs written before ``layer_types`` existed: ``sliding_window_pattern`` 6, or only the
    window (every sixth layer global by the architecture's definition): the same model."""
    spec = SPECS["gemma3"]
    folder = write_folder(tmp_path / keys, spec, models["gemma3"])
    cfg_path = os.path.join(folder, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    del cfg["layer_types"], cfg["_sliding_window_pattern"]
    if keys == "sliding_window_pattern":
        cfg["sliding_window_pattern"] = 6
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    loaded = load_model(folder, "float32")
    assert loaded.config == hf_expected(spec)
    want = naive_reference.forward(hf_expected(spec), models["gemma3"], TOKENS)
    assert gap(logits(loaded.model), want) < ATOL
