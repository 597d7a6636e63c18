#include "gemm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "pool.h"

namespace forkline {

namespace {

constexpr int kCols = 16;  // output columns of a panel: two AVX2 registers
constexpr int kRows = 6;  // rows of x in a tile: 12 accumulators + 2 panel loads + 1 broadcast
// Panels a task dequantizes before its tiles run over them: they stay in L2 while every block of rows
// of x is read once per group.
constexpr size_t kGroupBytes = 192 * 1024;
// One thread's multiply-adds per microsecond, for the pool's policy (measured: ~110 GFLOP/s on 2
// Zen 3 cores at 128-512 rows).
constexpr double kMacsPerUs = 25000.0;

// Scalar: the same values and order as the AVX2 version (one rounding per fma).
void dequantize_panel_scalar(Format format, const void* wq, const float* wd, const float* wm, int blocks,
                             int n0, int N, float* P) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  for (int j = 0; j < kCols; ++j) {
    const int n = n0 + j;
    for (int64_t k = 0; n >= N && k < K; ++k) {
      P[k * kCols + j] = 0.0f;
    }
    for (int b = 0; n < N && b < blocks; ++b) {
      const int64_t nb = static_cast<int64_t>(n) * blocks + b;
      float* dst = P + b * 32 * kCols + j;
      if (format == Format::q8_0) {
        const int8_t* q = static_cast<const int8_t*>(wq) + n * K + b * 32;
        for (int i = 0; i < 32; ++i) {
          dst[i * kCols] = wd[nb] * static_cast<float>(q[i]);
        }
      } else {
        const uint8_t* q = static_cast<const uint8_t*>(wq) + n * (K / 2) + b * 16;
        for (int i = 0; i < 16; ++i) {
          dst[i * kCols] = std::fma(wd[nb], static_cast<float>(q[i] & 0x0F), wm[nb]);
          dst[(i + 16) * kCols] = std::fma(wd[nb], static_cast<float>(q[i] >> 4), wm[nb]);
        }
      }
    }
  }
}

template <int R>
void tile_scalar(const float* x, int64_t ldx, const float* P, int64_t K, float* y, int64_t ldy, int cols) {
  float acc[R][kCols] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kCols; ++j) {
        acc[r][j] = std::fma(x[r * ldx + k], P[k * kCols + j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    std::copy(acc[r], acc[r] + cols, y + r * ldy);
  }
}

#if FORKLINE_X86

// Eight rows' 8-float vectors v[0..7] (row i: columns c..c+7) -> eight column vectors (column c+t: rows
// 0..7), in place.
AVX2_FN FORKLINE_INLINE void transpose8(__m256* v) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Weights 8g .. 8g+7 of block b of weight row n (the float kernels' values), as floats.
AVX2_FN FORKLINE_INLINE __m256 weights8(Format format, const void* wq, const float* wd, const float* wm,
                                        int blocks, int n, int b, int g) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  const int64_t nb = static_cast<int64_t>(n) * blocks + b;
  const __m256 d = _mm256_broadcast_ss(wd + nb);
  if (format == Format::q8_0) {
    const int8_t* q = static_cast<const int8_t*>(wq) + n * K + b * 32 + g * 8;
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(w));
  }
  // q4_1: byte i holds weight i (low nibble) and i + 16 (high): groups 0, 1 low, 2, 3 high
  const uint8_t* q = static_cast<const uint8_t*>(wq) + n * (K / 2) + b * 16 + (g & 1) * 8;
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  bytes = g < 2 ? bytes : _mm_srli_epi16(bytes, 4);
  bytes = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  return _mm256_fmadd_ps(d, w, _mm256_broadcast_ss(wm + nb));
}

AVX2_FN void dequantize_panel_avx2(Format format, const void* wq, const float* wd, const float* wm,
                                   int blocks, int n0, int N, float* P) {
  if (n0 + kCols > N) {  // a partial panel: rare (every model's widths are multiples of 16)
    dequantize_panel_scalar(format, wq, wd, wm, blocks, n0, N, P);
    return;
  }
  __m256 v[8];
  for (int b = 0; b < blocks; ++b) {
    for (int half = 0; half < 2; ++half) {  // panel columns 0..7, 8..15
      for (int g = 0; g < 4; ++g) {  // weights 8g .. 8g+7 of the block
        for (int i = 0; i < 8; ++i) {
          v[i] = weights8(format, wq, wd, wm, blocks, n0 + half * 8 + i, b, g);
        }
        transpose8(v);
        float* dst = P + (static_cast<int64_t>(b) * 32 + g * 8) * kCols + half * 8;
        for (int t = 0; t < 8; ++t) {
          _mm256_storeu_ps(dst + t * kCols, v[t]);
        }
      }
    }
  }
}

template <int R>
AVX2_FN void tile_avx2(const float* x, int64_t ldx, const float* P, int64_t K, float* y, int64_t ldy,
                       int cols) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    a0[r] = _mm256_setzero_ps();
    a1[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 p0 = _mm256_loadu_ps(P + k * kCols), p1 = _mm256_loadu_ps(P + k * kCols + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      a0[r] = _mm256_fmadd_ps(xv, p0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xv, p1, a1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    if (cols == kCols) {
      _mm256_storeu_ps(y + r * ldy, a0[r]);
      _mm256_storeu_ps(y + r * ldy + 8, a1[r]);
    } else {
      alignas(32) float row[kCols];
      _mm256_store_ps(row, a0[r]);
      _mm256_store_ps(row + 8, a1[r]);
      std::copy(row, row + cols, y + r * ldy);
    }
  }
}

#endif

using Tile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int);

template <int... R>
struct Tiles {
  static constexpr Tile scalar[] = {tile_scalar<R>...};
#if FORKLINE_X86
  static constexpr Tile avx2[] = {tile_avx2<R>...};
#endif
};
using TileTable = Tiles<1, 2, 3, 4, 5, 6>;

}  // namespace

void panel_matmul(Isa isa, Format format, const float* x, int M, int blocks, int N, const void* wq,
                  const float* scales, const float* mins, float* y, int64_t ldy) {
  if (M == 0 || N == 0) {
    return;
  }
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  const int panels = (N + kCols - 1) / kCols;
  const size_t panel_floats = static_cast<size_t>(K) * kCols;
  const int group = std::clamp(static_cast<int>(kGroupBytes / (panel_floats * sizeof(float))), 1, panels);
  const int tasks = (panels + group - 1) / group;
  const double est_us = static_cast<double>(M) * N * K / kMacsPerUs;
#if FORKLINE_X86
  const bool vector = isa != Isa::scalar;
#else
  const bool vector = false;
#endif
  pool().run_estimated(tasks, est_us, [&](int task) {
    thread_local std::vector<float> buffer;  // this thread's own panels
    const int p0 = task * group, p1 = std::min(panels, p0 + group);
    buffer.resize(panel_floats * (p1 - p0));
    for (int p = p0; p < p1; ++p) {
      float* P = buffer.data() + panel_floats * (p - p0);
#if FORKLINE_X86
      if (vector) {
        dequantize_panel_avx2(format, wq, scales, mins, blocks, p * kCols, N, P);
        continue;
      }
#endif
      dequantize_panel_scalar(format, wq, scales, mins, blocks, p * kCols, N, P);
    }
    for (int m0 = 0; m0 < M; m0 += kRows) {
      const int rows = std::min(kRows, M - m0);
#if FORKLINE_X86
      const Tile tile = vector ? TileTable::avx2[rows - 1] : TileTable::scalar[rows - 1];
#else
      const Tile tile = TileTable::scalar[rows - 1];
#endif
      for (int p = p0; p < p1; ++p) {
        const float* P = buffer.data() + panel_floats * (p - p0);
        tile(x + m0 * K, K, P, K, y + m0 * ldy + p * kCols, ldy, std::min(kCols, N - p * kCols));
      }
    }
  });
}

}  // namespace forkline
