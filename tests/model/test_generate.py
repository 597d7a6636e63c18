"""The greedy generation loop and the ``python -m engine_service.greedy`` command."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest

from engine_service.api.errors import InvalidArgument
from engine_service.greedy import greedy_tokens, new_cache
from engine_service.model import load_model
from engine_service.model.random_init import random_tensors, tiny_config
from tests.model.gguf_writer import write_gguf
from tests.model.reference_cache import ReferenceCache, run
from tests.unit.model.test_loading import gguf_metadata, gguf_tensors


def reference_greedy(model, prompt, n, stop=()):
    """Cold recompute of the whole sequence for every new token (no cache reuse at all)."""
    seq = list(prompt)
    out = []
    for _ in range(n):
        cache = ReferenceCache(model.config.layers)
        tok = int(mx.argmax(run(model, cache, [(cache.seq_new(), 0, seq)])[0]))
        out.append(tok)
        if tok in stop:
            break
        seq.append(tok)
    return out


@pytest.mark.parametrize("chunk", [3, 512])
def test_greedy_with_batched_sequence_cache_equals_cold_recompute(tiny_model, chunk):
    model = tiny_model("FRFR", window=4, seed=11, tie_embeddings=False)
    prompt = [7, 8, 9, 100, 101, 102, 5]
    cache = new_cache(model, 64, prefill_chunk=chunk)
    got = list(greedy_tokens(model, cache, cache.seq_new(), prompt, 12, chunk=chunk))
    assert got == reference_greedy(model, prompt, 12)
    assert len(set(got)) > 1  # not a degenerate constant stream


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_greedy_refuses_token_ids_outside_the_vocabulary(tiny_model, bad):
    """An out-of-range id would index the embedding table out of bounds: refused before any forward."""
    model = tiny_model("FRFR", window=4)
    cache = new_cache(model, 32)
    seq = cache.seq_new()
    with pytest.raises(InvalidArgument, match=rf"tokens\[1\] = {bad} is outside the vocabulary"):
        next(greedy_tokens(model, cache, seq, [3, bad, 4], 2))
    assert cache.pos(seq) == 0


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "engine_service.greedy", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _assert_one_line_error(proc, path):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}: "), proc.stderr


def test_cli_errors(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    _assert_one_line_error(cli("--model", missing, "hi"), missing)
    empty = tmp_path / "folder"
    empty.mkdir()
    _assert_one_line_error(cli("--model", str(empty), "hi"), str(empty))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    _assert_one_line_error(cli("--model", str(truncated), "hi"), str(truncated))


def test_cli_streams_the_greedy_continuation(tmp_path):
    config = tiny_config("RR", 4)
    tensors = random_tensors(config, seed=7)
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, gguf_metadata(), gguf_tensors(tensors))
    loaded = load_model(path, "float32")
    prompt = "abc def"
    ids = loaded.tokenizer.encode(prompt)
    want = reference_greedy(loaded.model, ids, 8, stop=loaded.tokenizer.eos_token_ids)
    want = [t for t in want if t not in loaded.tokenizer.eos_token_ids]
    proc = cli("--model", path, "--no-chat", "--max_new_tokens", "8", "--weights_dtype", "float32", prompt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == loaded.tokenizer.decode(want, skip_special_tokens=True) + "\n"
    assert "weights float32" in proc.stderr and "BLAS" in proc.stderr
