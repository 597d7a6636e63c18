// Quantized dot-product kernels: one scalar reference and one AVX2+FMA version of each, bitwise equal.
//
// Weight formats (row-major, K padded to a multiple of 32 with zero weights):
//   q8_0: wq int8 [N, K] in [-127, 127], wd float [N, K/32]; w = wd[b] * wq
//   q4_1: wq uint8 [N, K/2], one 16-byte block per 32 weights: byte i holds weight i in its low nibble
//         and weight i+16 in its high nibble; wd, wm float [N, K/32]; w = wd[b] * q + wm[b]
// Two activation modes:
// - float (the *_f32 kernels, what the engine uses): weights are widened to float in registers and scaled
//   per block, w'_i = wd[b] * q_i (q8_0) or fma(wd[b], q_i, wm[b]) (q4_1, one rounding), then multiplied
//   with float32 activations; per block, 16 lanes acc_j = fma(w'[16+j], x[16+j], fma(w'[j], x[j], acc_j))
//   (j < 16: one AVX-512 register, two AVX2 ones); at the end the lanes fold to eight, acc_j + acc_{j+8},
//   then the fixed reduction below. Only float rounding separates the result from float64 arithmetic
//   on the dequantized weights (~1e-6 relative); the scaled weights are the float32 dequantization
//   (q4_1's rounded once, by the fma).
// - int8 (the others): activations quantized per 32-block (xd[b] = amax/127, xq = rint(x * 127/amax)), so
//   a block dot product is exact in int32; lane j += (wd*xd) * (int sum of elements 4j..4j+3). Faster at
//   many rows, but costs ~1 logit of accuracy on SmolLM2 (its activations have outliers).
// In both, the scalar and AVX2 versions follow the same order and end with the same fixed pairwise sum
// of the eight lanes: they agree bit for bit, and every output depends only on its own row of x and of
// W: the same for any batch size, thread count or tile. The float kernels run register tiles of up to
// 8 rows of x x 3 or 4 rows of W (each widened, scaled weight block serves the tile's rows, each x block its
// weight rows; 4 x 1 on AVX2's 16 registers, up to 8 x 3 / 6 x 4 with AVX-512's 32, one or two rows x 1 or 4
// rows of W when memory-bound, adjacent or "spread": runs of a task's rows read side by side): one
// accumulator per output, so a tile changes which loads are shared, never an output's operations.
#pragma once

#include <cstdint>

namespace forkline {

// avx512: the AVX2 kernels, with the register-hungry float tiles compiled for AVX-512VL's 32 vector
// registers (same operations, same bits; wider tiles). Ordered: a higher level needs the lower ones.
enum class Isa { scalar = 0, avx2 = 1, avx512 = 2 };

// The best ISA this CPU supports (runtime check), and the one kernels use (FORKLINE_KERNEL_ISA=scalar
// or avx2, or set_isa(), picks a lower one; asking for more than the CPU has gives best_isa()).
Isa best_isa();
Isa active_isa();
void set_isa(Isa isa);
const char* isa_name(Isa isa);
// "scalar" / "avx2" / "avx512" -> isa; false for another name.
bool parse_isa(const char* name, Isa& isa);

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

// Float activations: x [M, blocks * 32] row-major (zero-padded). out[m * ldo + n] for m in [0, M),
// n in [n0, n1).
void q8_0_rows_f32(Isa isa, const int8_t* wq, const float* wd, int blocks, int n0, int n1, const float* x,
                   int M, float* out, int64_t ldo);
void q4_1_rows_f32(Isa isa, const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
                   const float* x, int M, float* out, int64_t ldo);
// The float kernels' tile (activation rows 1..8 x weight rows 1..4; 0: built-in). Speed only.
// spread: -1 built-in, 0 adjacent weight rows, 1 spread tiles (at one or two activation rows).
void set_f32_tile(int rows, int cols, int chunk = 0, int spread = -1);

}  // namespace forkline
