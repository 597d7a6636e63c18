"""``forkline_kernels.kv_store``: one op writing a layer's new K/V rows into a step's cache buffers.

References: numpy copies of the buffers with the rows assigned by hand; in place only when nothing else
holds a buffer (a live view keeps its old contents: the negative control for the in-place path); the
``batched-sequence`` cache gives the same buffers through the op as through MLX slice updates.
"""

from __future__ import annotations

import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)

mx = pytest.importorskip("mlx.core")
fk = pytest.importorskip("forkline_kernels", reason="compiled kernels not built (scripts/setup.sh)")


def address(a: mx.array) -> int:
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_rows_land_where_the_writes_say_and_nothing_else_changes(dtype):
    rng = np.random.default_rng(1)
    t, h, d = 7, 3, 16
    k = mx.array(rng.standard_normal((t, h, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((t, h, d)).astype(np.float32)).astype(dtype)
    sizes = (10, 4, 12)
    keys = [mx.array(rng.standard_normal((h, a, d)).astype(np.float32)).astype(dtype) for a in sizes]
    values = [mx.array(rng.standard_normal((h, a, d)).astype(np.float32)).astype(dtype) for a in sizes]
    writes = [(0, 0, 5, 2), (1, 2, 3, 1), (1, 3, 0, 2), (2, 5, 10, 2)]  # buffer 1: a ring's wrap
    want_k = [np.array(b.astype(mx.float32)) for b in keys]
    want_v = [np.array(b.astype(mx.float32)) for b in values]
    kn, vn = np.array(k.astype(mx.float32)), np.array(v.astype(mx.float32))
    for buf, src, dst, rows in writes:
        want_k[buf][:, dst : dst + rows, :] = kn[src : src + rows].transpose(1, 0, 2)
        want_v[buf][:, dst : dst + rows, :] = vn[src : src + rows].transpose(1, 0, 2)
    got_k, got_v = fk.kv_store(k, v, keys, values, writes)
    for g, w in zip([*got_k, *got_v], [*want_k, *want_v], strict=True):
        assert g.dtype == dtype
        assert np.array_equal(np.array(g.astype(mx.float32)), w)


def test_in_place_only_when_nothing_else_holds_the_buffer():
    k = mx.ones((1, 2, 8))
    keys, values = mx.zeros((2, 64, 8)) + 0, mx.zeros((2, 64, 8)) + 0
    mx.eval(k, keys, values)
    before = address(keys)
    (keys,), (values,) = fk.kv_store(k, k, [keys], [values], [(0, 0, 3, 1)])
    mx.eval(keys, values)
    assert address(keys) == before  # the cache's usual case: its buffer reused
    view = keys[:, :4, :]  # a live reader (an exported snapshot's slice)
    (k2,), (v2,) = fk.kv_store(k * 2, k, [keys], [values], [(0, 0, 3, 1)])
    mx.eval(k2, v2)
    assert address(k2) != address(keys)
    assert float(view[0, 3, 0]) == 1.0 and float(keys[0, 3, 0]) == 1.0 and float(k2[0, 3, 0]) == 2.0


def test_strided_inputs_are_read_by_their_strides():
    rng = np.random.default_rng(2)
    base = mx.array(rng.standard_normal((2, 5, 8)).astype(np.float32))
    k = base.transpose(1, 0, 2)  # [5, 2, 8], not row-contiguous
    buf = mx.array(rng.standard_normal((8, 6, 2)).astype(np.float32)).transpose(2, 1, 0)  # [2, 6, 8] strided
    (got,), _ = fk.kv_store(k, k, [buf], [mx.zeros((2, 6, 8))], [(0, 1, 2, 3)])
    want = np.array(buf).copy()
    want[:, 2:5, :] = np.array(k)[1:4].transpose(1, 0, 2)
    assert np.array_equal(np.array(got), want)


def test_bad_arguments_raise_value_error():
    k = mx.zeros((2, 2, 8))
    buf = mx.zeros((2, 4, 8))
    vbuf = mx.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="outside"):
        fk.kv_store(k, k, [buf], [vbuf], [(0, 0, 3, 2)])
    with pytest.raises(ValueError, match="outside"):
        fk.kv_store(k, k, [buf], [vbuf], [(1, 0, 0, 1)])
    with pytest.raises(ValueError, match="dtype"):
        fk.kv_store(k, k, [buf.astype(mx.float16)], [vbuf.astype(mx.float16)], [(0, 0, 0, 1)])
    with pytest.raises(ValueError, match="buffers must be"):
        fk.kv_store(k, k, [mx.zeros((3, 4, 8))], [mx.zeros((3, 4, 8))], [(0, 0, 0, 1)])
    with pytest.raises(ValueError, match="one length"):
        fk.kv_store(k, k, [buf], [], [])
    other = mx.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="distinct"):  # one buffer as keys and values: two outputs, one array
        fk.kv_store(k, k, [buf], [buf], [(0, 0, 0, 1)])
    with pytest.raises(ValueError, match="distinct"):
        fk.kv_store(k, k, [buf, buf], [other, mx.zeros((2, 4, 8))], [(0, 0, 0, 1)])


def test_sequence_cache_buffers_match_the_slice_update_path():
    """Flat and ring layers over wrapping steps of several sequences: the buffers written through the
    op equal those of the MLX slice-update path (a config without ``kv_store``), bitwise."""
    from dataclasses import replace

    from engine_service.cache.batch_control import Segment
    from engine_service.cache.batched_sequence import BatchedSequenceCache
    from engine_service.cache.config import CacheConfig, LayerSpec

    config = CacheConfig(
        capacity=512, max_seqs=3, layers=(LayerSpec(), LayerSpec("sliding", 4)), kv_heads=2, head_dim=8,
        initial_capacity=4, max_write=3, kv_store=fk.kv_store,
    )  # fmt: skip
    results = []
    for cfg in (config, replace(config, kv_store=None)):
        rng = np.random.default_rng(3)
        cache = BatchedSequenceCache(cfg)
        seqs = [cache.seq_new() for _ in range(3)]
        for step_rows in ([3, 1, 2], [1, 3, 1], [2, 2, 3], [1, 1, 1], [3, 3, 3]):
            segs = [Segment(s, cache.pos(s), n) for s, n in zip(seqs, step_rows, strict=True)]
            step = cache.begin_step(segs)
            total = sum(step_rows)
            for layer in range(2):
                k = mx.array(rng.standard_normal((total, 2, 8)).astype(np.float32))
                step.views(layer, k, k * 3)
            mx.eval(step.state())
        results.append([np.array(a) for s in seqs for a in cache.sequence(s).arrays()])
    assert len(results[0]) == len(results[1]) == 12
    for a, b in zip(*results, strict=True):
        assert np.array_equal(a, b)
