// Panel GEMM for long blocks of rows (prefill on AVX2): y = x @ W.T for a block-quantized W, without
// a float32 copy of W in memory.
//
// W is taken 16 output columns at a time: each panel is dequantized (the float kernels' values: wd * q,
// or fma(wd, q, wm) for q4_1) into a per-thread buffer laid out k-major, P[k][16], and a register tile
// of up to 6 rows of x x 16 columns accumulates acc[r][j] = fma(x[r][k], P[k][j], acc[r][j]) for
// k = 0, 1, ... in order. Every output is that one sequential sum: it depends only on its own row of x
// and of W (any row count, tile, panel group or thread count gives the same bits; the scalar version
// follows the same order with std::fma). It is not the order of the dot-product kernels of qdot.h, so
// the two differ in the last bits: the ordinary mode uses it where it used BLAS, the deterministic
// mode never.
#pragma once

#include <cstdint>

#include "qdot.h"
#include "qmatmul.h"

namespace forkline {

// y[m * ldy + j] for m < M, j < N; x dense [M, blocks * 32], zero-padded; over the worker pool.
void panel_matmul(Isa isa, Format format, const float* x, int M, int blocks, int N, const void* wq,
                  const float* scales, const float* mins, float* y, int64_t ldy);

}  // namespace forkline
