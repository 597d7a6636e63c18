#include "qdot.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "common.h"

namespace forkline {

namespace {

// Rows of W per tile: one activation block is loaded once and dotted with this many weight rows,
// giving independent accumulation chains. Any tiling gives the same result per output.
constexpr int kTile = 4;
// Activation rows per pass over a weight tile: those rows' quantized blocks stay in L1/L2.
constexpr int kRowChunk = 64;
// Float tiles: at most kMaxRows activation rows x kMaxCols weight rows; weight rows per pass over all
// activation rows (their blocks stay in L2 while every row tile reads them).
constexpr int kMaxRows = 8, kMaxCols = 4;
constexpr int kColChunk = 128;
// A forced float tile shape (rows x outputs; 0: the built-in choice). Only speed depends on it.
// g_tile_spread: -1 built-in, 0 adjacent weight rows, 1 spread (see TileShape).
std::atomic<int> g_tile_rows{0}, g_tile_cols{0}, g_col_chunk{kColChunk}, g_tile_spread{-1};

// spread: the tile's weight rows are not adjacent but `cols` runs of a task's rows read side by side
// (tile i takes row i of each run), so each run streams in order while the tile keeps `cols`
// independent FMA chains (only for the one tile row of <= 2 activation rows).
struct TileShape {
  int rows, cols;
  bool spread = false;
};

// The tile for the next `left` rows (measured by bench/bench_kernels_matmul.py with a model's worth
// of distinct weights, so they stream from memory as in decode). One or two rows are memory-bound:
// on an AVX-512 Xeon several weight rows a pass keep independent FMA chains in flight (one row's chain
// of 2 dependent FMAs per block capped it at ~12 GB/s): 4 with AVX-512; AVX2's 16 registers hold 4
// only for one row of q8_0 (the Gemma 3 head 1.2-1.3x, SmolLM2's q4_1 layers 1.03-1.4x). AMD's Zen 5
// streamed long rows best one at a time, q4_1's short ones (<= 384 bytes) 4 at a time. On Zen 3 (AVX2)
// adjacent long rows streamed at 0.75-0.85x one row (a 1 x 4 tile's rows 640 bytes apart break the
// stream every row), while one row is latency-bound (its 2-FMA chain per block): two rows half a task
// apart (spread) took the Gemma 3 head from 13-15 to 15-18 GB/s on 2 cores (18.6 is a plain read's)
// and its decode step 25.7 -> 21.7 ms; SmolLM2's q4_1 layers, issue-bound, were unchanged.
// More rows are compute-bound: a weight block is widened and scaled once (4 vector operations per
// 16 lanes) for the tile's rows, each of which then costs 2 FMAs per 16 lanes, and a row's x block is
// loaded into registers once for the tile's weight rows. AVX-512 (32 registers, an output's 16 lanes in
// one) takes up to 8 rows, `left` split into near-equal tiles (12 rows: 6 + 6, 16: 8 + 8), x 4 weight
// rows up to 6 rows and x 3 above (8 x 3 ran 1.05-1.2x 6 x 4 and 4 x 4 at 8-24 rows on the Xeon);
// AVX2 (16 registers, two per output) 4 x 1.
bool amd_cores() {
#if FORKLINE_X86
  static const bool amd = (__builtin_cpu_init(), __builtin_cpu_is("amd"));
  return amd;
#else
  return false;
#endif
}

TileShape f32_tile_shape(int left, bool wide, bool q41, int64_t row_bytes) {
  TileShape t;
  if (left <= 2 && amd_cores()) {
    const bool short_q41 = q41 && row_bytes <= 384;
    t = short_q41 ? TileShape{left, wide || left == 1 ? 4 : 2} : TileShape{left, wide ? 1 : 2, !wide};
  } else if (left <= 2) {
    t = {left, wide || (left == 1 && !q41) ? 4 : 2};
  } else if (wide) {
    const int tiles = (left + kMaxRows - 1) / kMaxRows;
    const int rows = (left + tiles - 1) / tiles;
    t = {rows, rows > 6 ? 3 : 4};  // 32 registers: 7-8 rows x 3 weight rows, up to 6 x 4
  } else {
    t = {std::min(left, 4), 1};
  }
  const int r = g_tile_rows.load(std::memory_order_relaxed), c = g_tile_cols.load(std::memory_order_relaxed);
  if (r > 0) {
    t.rows = std::min(r, left);
  }
  if (c > 0) {
    t.cols = c;
  }
  const int spread = g_tile_spread.load(std::memory_order_relaxed);
  if (spread >= 0) {
    t.spread = spread == 1 && t.rows == left && left <= 2;
  }
  return t;
}

Isa detect() {
#if FORKLINE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) {
      return Isa::avx512;
    }
    return Isa::avx2;
  }
#endif
  return Isa::scalar;
}

Isa initial_isa() {
  const Isa best = detect();
  Isa want;
  const char* env = std::getenv("FORKLINE_KERNEL_ISA");
  if (env != nullptr && parse_isa(env, want) && want < best) {
    return want;
  }
  return best;
}

std::atomic<int> g_isa{static_cast<int>(initial_isa())};

// ---------------------------------------------------------------- scalar reference

void quantize_block_scalar(const float* v, int8_t* q, float* d, float* s) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) {
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int i = 0; i < 32; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
    sum += q[i];
  }
  *d = amax / 127.0f;
  *s = *d * static_cast<float>(sum);
}

void q8_0_rows_scalar(const int8_t* wq, const float* wd, int blocks, int n0, int n1,
                      const QuantizedRows& x, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  for (int m = 0; m < M; ++m) {
    const int8_t* xq = x.q + m * K;
    const float* xd = x.d + static_cast<int64_t>(m) * blocks;
    for (int n = n0; n < n1; ++n) {
      const int8_t* w = wq + n * K;
      const float* d = wd + static_cast<int64_t>(n) * blocks;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int b = 0; b < blocks; ++b) {
        const float scale = d[b] * xd[b];
        for (int j = 0; j < 8; ++j) {
          int lane = 0;
          for (int k = 0; k < 4; ++k) {
            const int i = b * 32 + j * 4 + k;
            lane += static_cast<int>(w[i]) * static_cast<int>(xq[i]);
          }
          acc[j] = std::fma(scale, static_cast<float>(lane), acc[j]);
        }
      }
      out[m * ldo + n] = reduce8(acc);
    }
  }
}

void q4_1_rows_scalar(const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
                      const QuantizedRows& x, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  for (int m = 0; m < M; ++m) {
    const int8_t* xq = x.q + m * K;
    const float* xd = x.d + static_cast<int64_t>(m) * blocks;
    const float* xs = x.s + static_cast<int64_t>(m) * blocks;
    for (int n = n0; n < n1; ++n) {
      const uint8_t* w = wq + n * (K / 2);
      const float* d = wd + static_cast<int64_t>(n) * blocks;
      const float* mn = wm + static_cast<int64_t>(n) * blocks;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      float offset = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        const float scale = d[b] * xd[b];
        const uint8_t* wb = w + b * 16;
        for (int j = 0; j < 8; ++j) {
          int lane = 0;
          for (int k = 0; k < 4; ++k) {
            const int e = j * 4 + k;
            const int q = e < 16 ? (wb[e] & 0x0F) : (wb[e - 16] >> 4);
            lane += q * static_cast<int>(xq[b * 32 + e]);
          }
          acc[j] = std::fma(scale, static_cast<float>(lane), acc[j]);
        }
        offset = std::fma(mn[b], xs[b], offset);
      }
      out[m * ldo + n] = reduce8(acc) + offset;
    }
  }
}

// The float kernels' arithmetic (see qdot.h): a block's weights scaled first, w'_i = d * q_i (q8_0) or
// fma(d, q_i, m) (q4_1), then per block 16 lanes acc_j = fma(w'[16+j], x[16+j], fma(w'[j], x[j], acc_j));
// at the end the 16 lanes fold to 8 (acc_j + acc_{j+8}) and reduce8.
inline void block_fma16(const float* w, const float* x, float* acc) {
  for (int j = 0; j < 16; ++j) {
    acc[j] = std::fma(w[16 + j], x[16 + j], std::fma(w[j], x[j], acc[j]));
  }
}

inline float reduce16(const float* acc) {
  float t[8];
  for (int j = 0; j < 8; ++j) {
    t[j] = acc[j] + acc[j + 8];
  }
  return reduce8(t);
}

void q8_0_rows_f32_scalar(const int8_t* wq, const float* wd, int blocks, int n0, int n1, const float* x,
                          int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  float w[32];
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < M; ++m) {
      float acc[16] = {};
      for (int b = 0; b < blocks; ++b) {
        const float d = wd[static_cast<int64_t>(n) * blocks + b];
        for (int i = 0; i < 32; ++i) {
          w[i] = d * static_cast<float>(wq[n * K + b * 32 + i]);
        }
        block_fma16(w, x + m * K + b * 32, acc);
      }
      out[m * ldo + n] = reduce16(acc);
    }
  }
}

void q4_1_rows_f32_scalar(const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
                          const float* x, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  float w[32];
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < M; ++m) {
      float acc[16] = {};
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* wb = wq + n * (K / 2) + b * 16;
        const int64_t nb = static_cast<int64_t>(n) * blocks + b;
        for (int i = 0; i < 16; ++i) {
          w[i] = std::fma(wd[nb], static_cast<float>(wb[i] & 0x0F), wm[nb]);
          w[i + 16] = std::fma(wd[nb], static_cast<float>(wb[i] >> 4), wm[nb]);
        }
        block_fma16(w, x + m * K + b * 32, acc);
      }
      out[m * ldo + n] = reduce16(acc);
    }
  }
}

// ---------------------------------------------------------------- AVX2 + FMA

#if FORKLINE_X86

AVX2_FN void quantize_block_avx2(const float* v, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8);
  __m256 x2 = _mm256_loadu_ps(v + 16), x3 = _mm256_loadu_ps(v + 24);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, x2), _mm256_andnot_ps(sign, x3)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  const __m256 idv = _mm256_set1_ps(id);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x0, idv), kRound));
  __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x1, idv), kRound));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x2, idv), kRound));
  __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(x3, idv), kRound));
  // int32 sum of the block before narrowing (values are in [-127, 127]: exact)
  __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0x4E));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 0xB1));
  const int sum = _mm_cvtsi128_si32(sum4);
  // narrow 4 x 8 int32 -> 32 int8; packs work per 128-bit lane, the permute restores element order
  __m256i p01 = _mm256_packs_epi32(i0, i1);
  __m256i p23 = _mm256_packs_epi32(i2, i3);
  __m256i p = _mm256_packs_epi16(p01, p23);
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  *d = amax / 127.0f;
  *s = *d * static_cast<float>(sum);
}

// Dots of R weight rows with one activation row (R independent accumulators).
template <int R>
AVX2_FN inline void q8_0_tile_avx2(const int8_t* const* w, const float* const* wd, int blocks,
                                   const int8_t* xq, const float* xd, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
  }
  for (int b = 0; b < blocks; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    const __m256i ax = _mm256_sign_epi8(xv, xv);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + b * 32));
      // |x| * (w with x's sign) = x * w; pairs summed in int16 (<= 2 * 127 * 127: no saturation)
      const __m256i p16 = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
      const __m256i p32 = _mm256_madd_epi16(p16, ones);  // lane j: elements 4j..4j+3
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd[r][b] * xd[b]), _mm256_cvtepi32_ps(p32), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = reduce8_avx2(acc[r]);
  }
}

AVX2_FN void q8_0_rows_avx2(const int8_t* wq, const float* wd, int blocks, int n0, int n1,
                            const QuantizedRows& x, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  for (int m0 = 0; m0 < M; m0 += kRowChunk) {
    const int m1 = std::min(M, m0 + kRowChunk);
    for (int n = n0; n < n1; n += kTile) {
      const int r = std::min(kTile, n1 - n);
      const int8_t* w[kTile];
      const float* d[kTile];
      for (int i = 0; i < r; ++i) {
        w[i] = wq + (n + i) * K;
        d[i] = wd + static_cast<int64_t>(n + i) * blocks;
      }
      if (n + kTile < n1) {  // the next tile's first lines; the hardware prefetcher follows
        for (int i = 0; i < kTile; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(wq + (n + kTile + i) * K), _MM_HINT_T0);
        }
      }
      for (int m = m0; m < m1; ++m) {
        const int8_t* xq = x.q + m * K;
        const float* xd = x.d + static_cast<int64_t>(m) * blocks;
        float res[kTile];
        switch (r) {
          case 4: q8_0_tile_avx2<4>(w, d, blocks, xq, xd, res); break;
          case 3: q8_0_tile_avx2<3>(w, d, blocks, xq, xd, res); break;
          case 2: q8_0_tile_avx2<2>(w, d, blocks, xq, xd, res); break;
          default: q8_0_tile_avx2<1>(w, d, blocks, xq, xd, res); break;
        }
        for (int i = 0; i < r; ++i) {
          out[m * ldo + n + i] = res[i];
        }
      }
    }
  }
}

template <int R>
AVX2_FN inline void q4_1_tile_avx2(const uint8_t* const* w, const float* const* wd,
                                   const float* const* wm, int blocks, const int8_t* xq,
                                   const float* xd, const float* xs, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.0f;
  }
  for (int b = 0; b < blocks; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
    for (int r = 0; r < R; ++r) {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + b * 16));
      const __m128i lo = _mm_and_si128(packed, low);  // weights 0..15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);  // weights 16..31
      const __m256i qv = _mm256_set_m128i(hi, lo);
      const __m256i p16 = _mm256_maddubs_epi16(qv, xv);  // q in [0, 15]: unsigned operand
      const __m256i p32 = _mm256_madd_epi16(p16, ones);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd[r][b] * xd[b]), _mm256_cvtepi32_ps(p32), acc[r]);
      offset[r] = std::fma(wm[r][b], xs[b], offset[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r] = reduce8_avx2(acc[r]) + offset[r];
  }
}

AVX2_FN void q4_1_rows_avx2(const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0,
                            int n1, const QuantizedRows& x, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  for (int m0 = 0; m0 < M; m0 += kRowChunk) {
    const int m1 = std::min(M, m0 + kRowChunk);
    for (int n = n0; n < n1; n += kTile) {
      const int r = std::min(kTile, n1 - n);
      const uint8_t* w[kTile];
      const float* d[kTile];
      const float* mn[kTile];
      for (int i = 0; i < r; ++i) {
        w[i] = wq + (n + i) * (K / 2);
        d[i] = wd + static_cast<int64_t>(n + i) * blocks;
        mn[i] = wm + static_cast<int64_t>(n + i) * blocks;
      }
      if (n + kTile < n1) {
        for (int i = 0; i < kTile; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(wq + (n + kTile + i) * (K / 2)), _MM_HINT_T0);
        }
      }
      for (int m = m0; m < m1; ++m) {
        const int8_t* xq = x.q + m * K;
        const float* xd = x.d + static_cast<int64_t>(m) * blocks;
        const float* xs = x.s + static_cast<int64_t>(m) * blocks;
        float res[kTile];
        switch (r) {
          case 4: q4_1_tile_avx2<4>(w, d, mn, blocks, xq, xd, xs, res); break;
          case 3: q4_1_tile_avx2<3>(w, d, mn, blocks, xq, xd, xs, res); break;
          case 2: q4_1_tile_avx2<2>(w, d, mn, blocks, xq, xd, xs, res); break;
          default: q4_1_tile_avx2<1>(w, d, mn, blocks, xq, xd, xs, res); break;
        }
        for (int i = 0; i < r; ++i) {
          out[m * ldo + n + i] = res[i];
        }
      }
    }
  }
}

// Float-activation tiles: RM activation rows x RN weight rows, one accumulator per (row, output). Each
// weight block is widened and scaled once and used by the RM rows; each activation block is loaded
// from L1 once per weight row (AVX2: the FMAs' memory operand) or once per tile (AVX-512: into two
// registers the tile's weight rows share). Every output's operations are the one-row kernel's, in its
// order, whatever the tile: the tile shape only decides which outputs share loads.
// A block's 32 scaled weights w' in four 8-lane registers (elements 0..7, 8..15, 16..23, 24..31).
AVX2_FN FORKLINE_INLINE void widen_q8_0(const int8_t* w, float d, __m256* wf) {
  const __m256 dv = _mm256_set1_ps(d);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * i));
    wf[i] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
  }
}

// 16 bytes: weights 0..15 in the low nibbles, 16..31 in the high ones.
AVX2_FN FORKLINE_INLINE void widen_q4_1(const uint8_t* w, float d, float mn, __m256* wf) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(mn);
  const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8)));
  wf[0] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), mv);
  wf[1] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), mv);
  wf[2] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), mv);
  wf[3] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), mv);
}

// What both tile bodies share. The scales (and mins) of the next RN weight rows -- the next tile's,
// when this tile is the last row tile of its column run -- prefetched at the start, and their blocks
// a line per row every 64 bytes as the tile goes: interleaved rows defeat the hardware stream
// prefetcher (a 1 x 4 q8_0 tile streaming from memory ran at 0.4x the one-row speed without it, 0.6x
// with it: hence one-row q8_0 tiles at one or two rows).
// The tile's rows are `stride` rows apart; `next` is the next tile's first row (RN rows on when they
// are adjacent, one row on when spread).
template <bool Q41, int RN>
AVX2_FN FORKLINE_INLINE void prefetch_scales(const float* wd, const float* wm, int64_t next, int64_t stride,
                                             int blocks) {
#pragma GCC unroll 4
  for (int n = 0; n < RN; ++n) {
    const int64_t row = (next + n * stride) * blocks;
    _mm_prefetch(reinterpret_cast<const char*>(wd + row), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wd + row) + 64, _MM_HINT_T0);
    if constexpr (Q41) {
      _mm_prefetch(reinterpret_cast<const char*>(wm + row), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wm + row) + 64, _MM_HINT_T0);
    }
  }
}

template <bool Q41, int RN>
AVX2_FN FORKLINE_INLINE void prefetch_block(const uint8_t* next, int64_t stride_bytes, int b) {
  if (b % (Q41 ? 4 : 2) == 0) {
#pragma GCC unroll 4
    for (int n = 0; n < RN; ++n) {
      _mm_prefetch(reinterpret_cast<const char*>(next + n * stride_bytes + b * (Q41 ? 16 : 32)), _MM_HINT_T0);
    }
  }
}

// out(m, n) = the fixed 8-lane reduction of folded[m][n] (each output's 16 lanes folded to 8).
template <int RM, int RN>
AVX2_FN FORKLINE_INLINE void store_tile(const __m256 (&folded)[RM][RN], float* out, int64_t ldo, int64_t stride) {
#pragma GCC unroll 8
  for (int m = 0; m < RM; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < RN; ++n) {
      out[m * ldo + n * stride] = reduce8_avx2(folded[m][n]);
    }
  }
}

// Outputs (m, n) for m < RM, n < RN: x rows from x (stride K), weight rows from wq's first. Inlined
// into one wrapper per register file below.
template <bool Q41, int RM, int RN>
AVX2_FN FORKLINE_INLINE void f32_tile_body(const void* wq, const float* wd, const float* wm, int blocks,
                                           const float* x, float* out, int64_t ldo, int64_t stride) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  const int64_t row_bytes = Q41 ? K / 2 : K, stride_bytes = stride * row_bytes;
  const uint8_t* w = static_cast<const uint8_t*>(wq);
  __m256 acc[RM][RN][2];  // lanes 0..7 and 8..15 of each output's 16
#pragma GCC unroll 4
  for (int n = 0; n < RN; ++n) {
#pragma GCC unroll 8
    for (int m = 0; m < RM; ++m) {
      acc[m][n][0] = acc[m][n][1] = _mm256_setzero_ps();
    }
  }
  const int64_t next_row = stride == 1 ? RN : 1;
  const uint8_t* next = w + next_row * row_bytes;
  prefetch_scales<Q41, RN>(wd, wm, next_row, stride, blocks);
  for (int b = 0; b < blocks; ++b) {
    prefetch_block<Q41, RN>(next, stride_bytes, b);
#pragma GCC unroll 4
    for (int n = 0; n < RN; ++n) {
      __m256 wf[4];
      if constexpr (Q41) {
        const int64_t nb = n * stride * blocks + b;
        widen_q4_1(w + n * stride_bytes + b * 16, wd[nb], wm[nb], wf);
      } else {
        widen_q8_0(reinterpret_cast<const int8_t*>(w) + n * stride_bytes + b * 32, wd[n * stride * blocks + b], wf);
      }
#pragma GCC unroll 8
      for (int m = 0; m < RM; ++m) {
        const float* xb = x + m * K + b * 32;
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256 lo = _mm256_fmadd_ps(wf[h], _mm256_loadu_ps(xb + 8 * h), acc[m][n][h]);
          acc[m][n][h] = _mm256_fmadd_ps(wf[2 + h], _mm256_loadu_ps(xb + 16 + 8 * h), lo);
        }
      }
    }
  }
  __m256 folded[RM][RN];
#pragma GCC unroll 8
  for (int m = 0; m < RM; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < RN; ++n) {
      folded[m][n] = _mm256_add_ps(acc[m][n][0], acc[m][n][1]);
    }
  }
  store_tile<RM, RN>(folded, out, ldo, stride);
}

// 16-lane widening and scaling (AVX-512): a block's w' 0..15 and 16..31 in two registers. q4_1 looks its
// nibbles up in the block's 16 possible values (one FMA, then one permute per 16 lanes; vpermps reads
// an index's low 4 bits only): the same fma(d, q, m) values as converting each nibble (1.1-1.24x at
// 1-32 rows on the Xeon, in cache and streaming).
AVX512_FN FORKLINE_INLINE void widen16_q4_1(const uint8_t* w, float d, float mn, __m512* wf) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(mn));
  wf[0] = _mm512_permutexvar_ps(b, table);
  wf[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

AVX512_FN FORKLINE_INLINE void widen16_q8_0(const int8_t* w, float d, __m512* wf) {
  const __m512 dv = _mm512_set1_ps(d);
  wf[0] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)))));
  wf[1] = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))));
}

// The same tile with AVX-512's 16-lane registers: one accumulator per output holds the 16 lanes the
// AVX2 tile keeps in two, with the same operations lane by lane (bitwise its results).
template <bool Q41, int RM, int RN>
AVX512_FN FORKLINE_INLINE void f32_tile_body16(const void* wq, const float* wd, const float* wm, int blocks,
                                               const float* x, float* out, int64_t ldo, int64_t stride) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  const int64_t row_bytes = Q41 ? K / 2 : K, stride_bytes = stride * row_bytes;
  const uint8_t* w = static_cast<const uint8_t*>(wq);
  __m512 acc[RM][RN];  // an output's 16 lanes in one register
#pragma GCC unroll 4
  for (int n = 0; n < RN; ++n) {
#pragma GCC unroll 8
    for (int m = 0; m < RM; ++m) {
      acc[m][n] = _mm512_setzero_ps();
    }
  }
  const int64_t next_row = stride == 1 ? RN : 1;
  const uint8_t* next = w + next_row * row_bytes;
  prefetch_scales<Q41, RN>(wd, wm, next_row, stride, blocks);
  for (int b = 0; b < blocks; ++b) {
    prefetch_block<Q41, RN>(next, stride_bytes, b);
    __m512 wf[RN][2];
#pragma GCC unroll 4
    for (int n = 0; n < RN; ++n) {
      if constexpr (Q41) {
        widen16_q4_1(w + n * stride_bytes + b * 16, wd[n * stride * blocks + b], wm[n * stride * blocks + b], wf[n]);
      } else {
        widen16_q8_0(reinterpret_cast<const int8_t*>(w) + n * stride_bytes + b * 32, wd[n * stride * blocks + b],
                     wf[n]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < RM; ++m) {  // the row's x block loaded once for the RN weight rows
      const float* xb = x + m * K + b * 32;
      __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      // in registers, not folded into each FMA: with a 512-bit load per FMA the tile ran at 0.75x
      // here (a Zen 5 core loads one 512-bit vector a cycle and runs two FMAs)
      asm("" : "+v"(x0), "+v"(x1));
#pragma GCC unroll 4
      for (int n = 0; n < RN; ++n) {
        acc[m][n] = _mm512_fmadd_ps(wf[n][1], x1, _mm512_fmadd_ps(wf[n][0], x0, acc[m][n]));
      }
    }
  }
  __m256 folded[RM][RN];
#pragma GCC unroll 8
  for (int m = 0; m < RM; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < RN; ++n) {
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[m][n]), 1));
      folded[m][n] = _mm256_add_ps(_mm512_castps512_ps256(acc[m][n]), hi);
    }
  }
  store_tile<RM, RN>(folded, out, ldo, stride);
}

template <bool Q41, int RM, int RN>
AVX2_FN void f32_tile_avx2(const void* wq, const float* wd, const float* wm, int blocks, const float* x,
                           float* out, int64_t ldo, int64_t stride) {
  f32_tile_body<Q41, RM, RN>(wq, wd, wm, blocks, x, out, ldo, stride);
}

template <bool Q41, int RM, int RN>
AVX512_FN void f32_tile_avx512(const void* wq, const float* wd, const float* wm, int blocks, const float* x,
                               float* out, int64_t ldo, int64_t stride) {
  f32_tile_body16<Q41, RM, RN>(wq, wd, wm, blocks, x, out, ldo, stride);
}

using F32Tile = void (*)(const void*, const float*, const float*, int, const float*, float*, int64_t, int64_t);
using TileTable = std::array<std::array<F32Tile, kMaxCols>, kMaxRows>;  // [rows - 1][cols - 1]

template <bool Q41, bool Wide, int RM, int... RN>
constexpr std::array<F32Tile, kMaxCols> tile_row(std::integer_sequence<int, RN...>) {
  if constexpr (Wide) {
    return {&f32_tile_avx512<Q41, RM, RN + 1>...};
  } else {
    return {&f32_tile_avx2<Q41, RM, RN + 1>...};
  }
}

template <bool Q41, bool Wide, int... RM>
constexpr TileTable tile_table(std::integer_sequence<int, RM...>) {
  return {tile_row<Q41, Wide, RM + 1>(std::make_integer_sequence<int, kMaxCols>())...};
}

constexpr TileTable kTiles[2][2] = {
    {tile_table<false, false>(std::make_integer_sequence<int, kMaxRows>()),
     tile_table<false, true>(std::make_integer_sequence<int, kMaxRows>())},
    {tile_table<true, false>(std::make_integer_sequence<int, kMaxRows>()),
     tile_table<true, true>(std::make_integer_sequence<int, kMaxRows>())},
};

// Weight rows [n0, n1) for all M rows: chunks of kColChunk weight rows (kept in L2) x row tiles x
// weight-row tiles.
template <bool Q41>
void rows_f32_tiled(Isa isa, const void* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
                    const float* x, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  const int64_t row_bytes = Q41 ? K / 2 : K;
  const bool wide = isa == Isa::avx512;
  const TileTable& table = kTiles[Q41][wide];
  const uint8_t* w = static_cast<const uint8_t*>(wq);
  const int chunk = g_col_chunk.load(std::memory_order_relaxed);
  const TileShape first = f32_tile_shape(M, wide, Q41, row_bytes);
  if (first.spread) {  // one tile row: `cols` runs of q weight rows side by side, the tail one at a time
    const auto tile = [&](int cols, int n, int64_t stride) {
      table[M - 1][cols - 1](w + n * row_bytes, wd + static_cast<int64_t>(n) * blocks,
                             Q41 ? wm + static_cast<int64_t>(n) * blocks : nullptr, blocks, x, out + n, ldo, stride);
    };
    const int q = (n1 - n0) / first.cols;
    for (int i = 0; i < q; ++i) {
      tile(first.cols, n0 + i, q);
    }
    for (int n = n0 + q * first.cols; n < n1; ++n) {
      tile(1, n, 1);
    }
    return;
  }
  for (int nc = n0; nc < n1; nc += chunk) {
    const int nce = std::min(n1, nc + chunk);
    for (int m = 0; m < M;) {
      const TileShape shape = f32_tile_shape(M - m, wide, Q41, row_bytes);
      for (int n = nc; n < nce; n += shape.cols) {
        const int rn = std::min(shape.cols, nce - n);
        table[shape.rows - 1][rn - 1](w + n * row_bytes, wd + static_cast<int64_t>(n) * blocks,
                                      Q41 ? wm + static_cast<int64_t>(n) * blocks : nullptr, blocks, x + m * K,
                                      out + m * ldo + n, ldo, 1);
      }
      m += shape.rows;
    }
  }
}

#endif  // FORKLINE_X86

}  // namespace

Isa best_isa() {
  static const Isa best = detect();
  return best;
}

Isa active_isa() {
  return static_cast<Isa>(g_isa.load(std::memory_order_relaxed));
}

void set_isa(Isa isa) {
  g_isa.store(static_cast<int>(std::min(isa, best_isa())));
}

const char* isa_name(Isa isa) {
  return isa == Isa::avx512 ? "avx512" : isa == Isa::avx2 ? "avx2" : "scalar";
}

bool parse_isa(const char* name, Isa& isa) {
  for (Isa i : {Isa::scalar, Isa::avx2, Isa::avx512}) {
    if (std::strcmp(name, isa_name(i)) == 0) {
      isa = i;
      return true;
    }
  }
  return false;
}

void quantize_rows(Isa isa, const float* x, int64_t row_stride, int64_t col_stride, int K, int blocks,
                   int r0, int r1, const QuantizedRows& out) {
  alignas(32) float tmp[32];
  for (int r = r0; r < r1; ++r) {
    const float* row = x + r * row_stride;
    for (int b = 0; b < blocks; ++b) {
      const int k0 = b * 32;
      const int n = std::min(32, K - k0);
      for (int i = 0; i < n; ++i) {
        tmp[i] = row[(k0 + i) * col_stride];
      }
      for (int i = n; i < 32; ++i) {
        tmp[i] = 0.0f;
      }
      int8_t* q = out.q + (static_cast<int64_t>(r) * blocks + b) * 32;
      float* d = out.d + static_cast<int64_t>(r) * blocks + b;
      float* s = out.s + static_cast<int64_t>(r) * blocks + b;
#if FORKLINE_X86
      if (isa != Isa::scalar) {
        quantize_block_avx2(tmp, q, d, s);
        continue;
      }
#endif
      quantize_block_scalar(tmp, q, d, s);
    }
  }
}

void q8_0_rows(Isa isa, const int8_t* wq, const float* wd, int blocks, int n0, int n1,
               const QuantizedRows& x, int M, float* out, int64_t ldo) {
#if FORKLINE_X86
  if (isa != Isa::scalar) {
    q8_0_rows_avx2(wq, wd, blocks, n0, n1, x, M, out, ldo);
    return;
  }
#endif
  q8_0_rows_scalar(wq, wd, blocks, n0, n1, x, M, out, ldo);
}

void q4_1_rows(Isa isa, const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
               const QuantizedRows& x, int M, float* out, int64_t ldo) {
#if FORKLINE_X86
  if (isa != Isa::scalar) {
    q4_1_rows_avx2(wq, wd, wm, blocks, n0, n1, x, M, out, ldo);
    return;
  }
#endif
  q4_1_rows_scalar(wq, wd, wm, blocks, n0, n1, x, M, out, ldo);
}

void set_f32_tile(int rows, int cols, int chunk, int spread) {
  g_tile_spread.store(std::clamp(spread, -1, 1));
  g_col_chunk.store(chunk > 0 ? chunk : kColChunk);
  g_tile_rows.store(std::clamp(rows, 0, kMaxRows));
  g_tile_cols.store(std::clamp(cols, 0, kMaxCols));
}

void q8_0_rows_f32(Isa isa, const int8_t* wq, const float* wd, int blocks, int n0, int n1, const float* x,
                   int M, float* out, int64_t ldo) {
#if FORKLINE_X86
  if (isa != Isa::scalar) {
    rows_f32_tiled<false>(isa, wq, wd, nullptr, blocks, n0, n1, x, M, out, ldo);
    return;
  }
#endif
  q8_0_rows_f32_scalar(wq, wd, blocks, n0, n1, x, M, out, ldo);
}

void q4_1_rows_f32(Isa isa, const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
                   const float* x, int M, float* out, int64_t ldo) {
#if FORKLINE_X86
  if (isa != Isa::scalar) {
    rows_f32_tiled<true>(isa, wq, wd, wm, blocks, n0, n1, x, M, out, ldo);
    return;
  }
#endif
  q4_1_rows_f32_scalar(wq, wd, wm, blocks, n0, n1, x, M, out, ldo);
}

}  // namespace forkline
