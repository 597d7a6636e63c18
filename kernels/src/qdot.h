// Quantized dot-product kernels: one scalar reference and one AVX2+FMA version of each, bitwise equal.
//
// Weight formats (row-major, K padded to a multiple of 32 with zero weights):
//   q8_0: wq int8 [N, K] in [-127, 127], wd float [N, K/32]; w = wd[b] * wq
//   q4_1: wq uint8 [N, K/2], one 16-byte block per 32 weights: byte i holds weight i in its low nibble
//         and weight i+16 in its high nibble; wd, wm float [N, K/32]; w = wd[b] * q + wm[b]
// Activations are quantized per 32-block to int8 (xd[b] = amax/127, xq = rint(x * 127/amax)), so a block
// dot product is exact in int32. Both versions accumulate each output in the same order: eight float
// lanes, lane j += (wd*xd) * (int sum of elements 4j..4j+3), then a fixed pairwise sum of the lanes. So
// the AVX2 result equals the scalar result bit for bit, and every output depends only on its own row
// of x and of W: the same for any batch size, thread count or tile.
#pragma once

#include <cstdint>

namespace forkline {

enum class Isa { scalar = 0, avx2 = 1 };

// The best ISA this CPU supports (runtime check), and the one kernels use (FORKLINE_KERNEL_ISA=scalar
// or set_isa() forces the fallback; asking for avx2 on a CPU without it keeps scalar).
Isa best_isa();
Isa active_isa();
void set_isa(Isa isa);
const char* isa_name(Isa isa);

// Quantized activations of `rows` rows of K floats (blocks = ceil(K/32); the tail is zero-padded).
struct QuantizedRows {
  int8_t* q;  // [rows, blocks * 32]
  float* d;  // [rows, blocks]
  float* s;  // [rows, blocks]: d * (sum of q in the block), for formats with an offset (q4_1)
};

// x(r, k) = x[r * row_stride + k * col_stride] for r in [r0, r1), k in [0, K).
void quantize_rows(Isa isa, const float* x, int64_t row_stride, int64_t col_stride, int K, int blocks,
                   int r0, int r1, const QuantizedRows& out);

// out[m * ldo + n] for m in [0, M), n in [n0, n1).
void q8_0_rows(Isa isa, const int8_t* wq, const float* wd, int blocks, int n0, int n1,
               const QuantizedRows& x, int M, float* out, int64_t ldo);
void q4_1_rows(Isa isa, const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
               const QuantizedRows& x, int M, float* out, int64_t ldo);

}  // namespace forkline
