"""The ggml block decoders on the real Gemma 3 GGUF (slow): each tensor type against the ``gguf``
package, and the 262144 x 640 Q8_0 embedding decoded in seconds (hand-built blocks and random bytes:
tests/unit/model/ggml_blocks/)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from engine_service.model.formats.ggml_blocks import EXACT_FORMAT, dequantize, exact_blocks32
from engine_service.model.loading.gguf_file import GGUFFile
from tests.unit.model.ggml_blocks.oracle import agree, oracle

GEMMA = "/root/.cache/forkline/models/gemma-3-270m-q4_k_m.gguf"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(GEMMA), reason=f"{GEMMA} is not installed")
def test_real_gemma_tensors_match_gguf_package():
    """The smallest tensor of each type in the real file, decoded from GGUFFile's bytes, equals the gguf
    package's dequantization; exact types' Blocks32 equal dequantize; the 262144 x 640 Q8_0 embedding
    decodes in seconds (a per-block Python loop would take far longer) and matches on sampled rows."""
    with GGUFFile(GEMMA) as f:
        smallest: dict[str, object] = {}
        for rec in f.tensors.values():
            if rec.type_name not in smallest or rec.nbytes < smallest[rec.type_name].nbytes:
                smallest[rec.type_name] = rec
        assert {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= set(smallest)
        for name, rec in smallest.items():
            rows, cols = rec.rows_cols
            data = f.tensor_bytes(rec.name)
            got = dequantize(rec.block, data, rows, cols)
            agree(got, oracle(name, data, rows))
            assert np.all(np.isfinite(got))
            ex = exact_blocks32(rec.block, data, rows, cols)
            assert (ex is None) == (name not in EXACT_FORMAT)
            if ex is not None:
                np.testing.assert_array_equal(ex.values(), got)
        rec = f.tensors["token_embd.weight"]
        assert rec.type_name == "Q8_0" and rec.rows_cols == (262144, 640)
        data = f.tensor_bytes(rec.name)
        start = time.process_time()  # CPU time: the claim is the decoder's cost, not the machine's load
        emb = dequantize(rec.block, data, *rec.rows_cols)
        assert time.process_time() - start < 10.0
        row_bytes = 640 // 32 * 34
        for r in (0, 1, 2, 131071, 262143):
            part = data[r * row_bytes : (r + 1) * row_bytes]
            agree(emb[r : r + 1], oracle("Q8_0", part, 1))
