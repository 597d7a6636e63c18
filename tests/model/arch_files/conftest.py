"""The tiny architectures' random weights and their quantized GGUF files, built once per test module."""

from __future__ import annotations

import numpy as np
import pytest

from tests.model import naive_reference
from tests.model.arch_files.gguf_layout import gguf_metadata, to_gguf
from tests.model.arch_files.tiny_archs import ARCHS, SPECS, TOKENS, expected_config, random_model
from tests.model.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def models() -> dict[str, dict[str, np.ndarray]]:
    return {arch: random_model(SPECS[arch]) for arch in ARCHS}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, models):
    """arch -> (path of the quantized GGUF, the canonical values it stands for, their reference logits)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ARCHS:
        spec = SPECS[arch]
        raw, values = to_gguf(spec, models[arch])
        path = str(root / f"{arch}.gguf")
        write_gguf(path, gguf_metadata(spec), raw)
        out[arch] = (path, values, naive_reference.forward(expected_config(spec), values, TOKENS))
    return out
