"""``forkline_kernels.categorical``: one draw per row by the inverse cumulative distribution.

Reference: numpy in float64 (softmax of the scaled logits, cumulative sum, the first entry whose sum passes
u times the total), compared where u is not within rounding of a boundary; every ISA bitwise equal; masked
entries never drawn; a row's draw independent of its batch. Negative control: the same comparison with the
uniforms shifted must fail."""

from __future__ import annotations

import numpy as np
import pytest

import engine_service  # noqa: F401  (OpenBLAS before mlx)

mx = pytest.importorskip("mlx.core")
fk = pytest.importorskip("forkline_kernels", reason="compiled kernels not built (scripts/setup.sh)")


def reference(x: np.ndarray, inv_t: float, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, whether each row's u is clear of a boundary by more than rounding)."""
    z = (x.astype(np.float64) - x.max(axis=1, keepdims=True)) * inv_t
    p = np.exp(z)
    cdf = np.cumsum(p, axis=1)
    target = u.astype(np.float64) * cdf[:, -1]
    tokens = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, target, strict=True)])
    gap = np.abs(cdf - target[:, None]).min(axis=1) / cdf[:, -1]
    return tokens, gap > 2e-6


def draw(x: np.ndarray, u: np.ndarray, inv_t: float) -> np.ndarray:
    out = fk.categorical(mx.array(x), mx.array(u), inv_temperature=inv_t)
    return np.array(out)


@pytest.mark.parametrize("vocab", [1, 7, 64, 65, 1000, 49152])
@pytest.mark.parametrize("inv_t", [0.5, 1.0, 3.0])
def test_draws_match_the_float64_inverse_cdf(vocab: int, inv_t: float) -> None:
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((64, vocab)) * 3).astype(np.float32)
    u = rng.random(64, dtype=np.float32)
    want, clear = reference(x, inv_t, u)
    got = draw(x, u, inv_t)
    assert clear.sum() >= 48
    np.testing.assert_array_equal(got[clear], want[clear])
    if vocab > 1:  # negative control: other uniforms give other tokens
        shifted = (u + np.float32(0.37)) % np.float32(1.0)
        assert (draw(x, shifted, inv_t)[clear] != want[clear]).any()


def test_every_isa_draws_the_same_tokens() -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((32, 4099)) * 4).astype(np.float32)
    x[:, ::7] = -np.inf
    u = rng.random(32, dtype=np.float32)
    before = fk.isa()
    try:
        results = {}
        for isa in ("scalar", "avx2", "avx512"):
            used = fk.set_isa(isa)
            results[used] = draw(x, u, 1.3)
    finally:
        fk.set_isa(before)
    values = list(results.values())
    for other in values[1:]:
        np.testing.assert_array_equal(other, values[0])


def test_masked_entries_are_never_drawn_and_the_ends_are_exact() -> None:
    x = np.full((4, 100), -np.inf, dtype=np.float32)
    x[:, [10, 50, 99]] = [0.0, 1.0, 2.0]
    u = np.array([0.0, 0.5, 0.9999999, 0.02], dtype=np.float32)
    got = draw(x, u, 1.0)
    assert set(got.tolist()) <= {10, 50, 99}
    assert got[0] == 10 and got[2] == 99  # u = 0: the first entry with weight; u -> 1: the last
    every = draw(np.full((1, 5), -np.inf, dtype=np.float32), np.array([0.5], dtype=np.float32), 1.0)
    assert every.tolist() == [0]  # nothing allowed: the first maximum, never out of range


def test_a_rows_draw_does_not_depend_on_its_batch() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 3000)).astype(np.float32)
    u = rng.random(9, dtype=np.float32)
    together = draw(x, u, 1.0)
    alone = [int(draw(x[i : i + 1], u[i : i + 1], 1.0)[0]) for i in range(9)]
    assert together.tolist() == alone
    strided = fk.categorical(mx.array(x.T).T, mx.array(u), inv_temperature=1.0)  # a transposed view
    assert np.array(strided).tolist() == alone


def test_a_huge_inverse_temperature_is_the_argmax() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 500)).astype(np.float32)
    u = rng.random(16, dtype=np.float32)
    np.testing.assert_array_equal(draw(x, u, 3.0e38), x.argmax(axis=1))


def test_bad_arguments_name_the_field() -> None:
    x = mx.zeros((2, 5))
    with pytest.raises(ValueError, match="logits"):
        fk.categorical(mx.zeros((5,)), mx.zeros((2,)))
    with pytest.raises(ValueError, match="uniforms"):
        fk.categorical(x, mx.zeros((3,)))
    with pytest.raises(ValueError, match="inv_temperature"):
        fk.categorical(x, mx.zeros((2,)), inv_temperature=0.0)
