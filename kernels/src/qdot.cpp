#include "qdot.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common.h"

namespace forkline {

namespace {

// Rows of W per tile: one activation block is loaded once and dotted with this many weight rows,
// giving independent accumulation chains. Any tiling gives the same result per output.
constexpr int kTile = 4;
// Activation rows per pass over a weight tile: those rows' quantized blocks stay in L1/L2.
constexpr int kRowChunk = 64;

// The fixed lane reduction both versions use: (a0+a4 + a2+a6) + (a1+a5 + a3+a7).
inline float reduce8(const float* a) {
  float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

Isa detect() {
#if FORKLINE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return Isa::avx2;
  }
#endif
  return Isa::scalar;
}

Isa initial_isa() {
  const char* env = std::getenv("FORKLINE_KERNEL_ISA");
  if (env != nullptr && std::strcmp(env, "scalar") == 0) {
    return Isa::scalar;
  }
  return detect();
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

// Widened weights of one block in element order; lanes as the AVX2 version: t_j over i = 0..3 of
// w[8i + j] * x[8i + j], the first a product, the rest fused.
inline void block_dot_lanes(const float* w, const float* x, float* t) {
  for (int j = 0; j < 8; ++j) {
    float v = w[j] * x[j];
    for (int i = 1; i < 4; ++i) {
      v = std::fma(w[8 * i + j], x[8 * i + j], v);
    }
    t[j] = v;
  }
}

void q8_0_rows_f32_scalar(const int8_t* wq, const float* wd, int blocks, int n0, int n1, const float* x,
                          int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  float w[32], t[8];
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < M; ++m) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int b = 0; b < blocks; ++b) {
        for (int i = 0; i < 32; ++i) {
          w[i] = static_cast<float>(wq[n * K + b * 32 + i]);
        }
        block_dot_lanes(w, x + m * K + b * 32, t);
        const float d = wd[static_cast<int64_t>(n) * blocks + b];
        for (int j = 0; j < 8; ++j) {
          acc[j] = std::fma(d, t[j], acc[j]);
        }
      }
      out[m * ldo + n] = reduce8(acc);
    }
  }
}

void q4_1_rows_f32_scalar(const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
                          const float* x, const float* xsum, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  float w[32], t[8];
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < M; ++m) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      float offset = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* wb = wq + n * (K / 2) + b * 16;
        for (int i = 0; i < 16; ++i) {
          w[i] = static_cast<float>(wb[i] & 0x0F);
          w[i + 16] = static_cast<float>(wb[i] >> 4);
        }
        block_dot_lanes(w, x + m * K + b * 32, t);
        const int64_t nb = static_cast<int64_t>(n) * blocks + b;
        for (int j = 0; j < 8; ++j) {
          acc[j] = std::fma(wd[nb], t[j], acc[j]);
        }
        offset = std::fma(wm[nb], xsum[static_cast<int64_t>(m) * blocks + b], offset);
      }
      out[m * ldo + n] = reduce8(acc) + offset;
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

// Float-activation tiles: one weight row, up to kXRows activation rows; the widened weight block is
// shared by the rows.
constexpr int kXRows = 4;

AVX2_FN inline __m256 block_dot_avx2(const __m256* w, const float* x) {
  __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
  t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), t);
  t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), t);
  return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), t);
}

template <int R>
AVX2_FN void q8_0_row_f32_avx2(const int8_t* w, const float* d, int blocks, const float* x, int64_t K,
                               float* out, int64_t ldo) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
  }
  for (int b = 0; b < blocks; ++b) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 32));
    const __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
    __m256 wf[4];
    wf[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    wf[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    wf[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    wf[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    const __m256 dv = _mm256_set1_ps(d[b]);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(dv, block_dot_avx2(wf, x + r * K + b * 32), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r * ldo] = reduce8_avx2(acc[r]);
  }
}

template <int R>
AVX2_FN void q4_1_row_f32_avx2(const uint8_t* w, const float* d, const float* mn, int blocks, const float* x,
                               const float* xsum, int64_t K, float* out, int64_t ldo) {
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.0f;
  }
  for (int b = 0; b < blocks; ++b) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + b * 16));
    const __m128i lo = _mm_and_si128(packed, low);  // weights 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);  // weights 16..31
    __m256 wf[4];
    wf[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    wf[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    wf[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    wf[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    const __m256 dv = _mm256_set1_ps(d[b]);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(dv, block_dot_avx2(wf, x + r * K + b * 32), acc[r]);
      offset[r] = std::fma(mn[b], xsum[r * blocks + b], offset[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    out[r * ldo] = reduce8_avx2(acc[r]) + offset[r];
  }
}

AVX2_FN void q8_0_rows_f32_avx2(const int8_t* wq, const float* wd, int blocks, int n0, int n1, const float* x,
                                int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  for (int m0 = 0; m0 < M; m0 += kRowChunk) {
    const int m1 = std::min(M, m0 + kRowChunk);
    for (int n = n0; n < n1; ++n) {
      const int8_t* w = wq + n * K;
      const float* d = wd + static_cast<int64_t>(n) * blocks;
      if (n + 1 < n1) {
        _mm_prefetch(reinterpret_cast<const char*>(w + K), _MM_HINT_T0);
      }
      int m = m0;
      for (; m + kXRows <= m1; m += kXRows) {
        q8_0_row_f32_avx2<kXRows>(w, d, blocks, x + m * K, K, out + m * ldo + n, ldo);
      }
      for (; m < m1; ++m) {
        q8_0_row_f32_avx2<1>(w, d, blocks, x + m * K, K, out + m * ldo + n, ldo);
      }
    }
  }
}

AVX2_FN void q4_1_rows_f32_avx2(const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0,
                                int n1, const float* x, const float* xsum, int M, float* out, int64_t ldo) {
  const int64_t K = static_cast<int64_t>(blocks) * 32;
  for (int m0 = 0; m0 < M; m0 += kRowChunk) {
    const int m1 = std::min(M, m0 + kRowChunk);
    for (int n = n0; n < n1; ++n) {
      const uint8_t* w = wq + n * (K / 2);
      const float* d = wd + static_cast<int64_t>(n) * blocks;
      const float* mn = wm + static_cast<int64_t>(n) * blocks;
      if (n + 1 < n1) {
        _mm_prefetch(reinterpret_cast<const char*>(w + K / 2), _MM_HINT_T0);
      }
      int m = m0;
      for (; m + kXRows <= m1; m += kXRows) {
        q4_1_row_f32_avx2<kXRows>(w, d, mn, blocks, x + m * K, xsum + static_cast<int64_t>(m) * blocks, K,
                                  out + m * ldo + n, ldo);
      }
      for (; m < m1; ++m) {
        q4_1_row_f32_avx2<1>(w, d, mn, blocks, x + m * K, xsum + static_cast<int64_t>(m) * blocks, K,
                             out + m * ldo + n, ldo);
      }
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
  if (isa == Isa::avx2 && best_isa() != Isa::avx2) {
    isa = Isa::scalar;
  }
  g_isa.store(static_cast<int>(isa));
}

const char* isa_name(Isa isa) {
  return isa == Isa::avx2 ? "avx2" : "scalar";
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
      if (isa == Isa::avx2) {
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
  if (isa == Isa::avx2) {
    q8_0_rows_avx2(wq, wd, blocks, n0, n1, x, M, out, ldo);
    return;
  }
#endif
  q8_0_rows_scalar(wq, wd, blocks, n0, n1, x, M, out, ldo);
}

void q4_1_rows(Isa isa, const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
               const QuantizedRows& x, int M, float* out, int64_t ldo) {
#if FORKLINE_X86
  if (isa == Isa::avx2) {
    q4_1_rows_avx2(wq, wd, wm, blocks, n0, n1, x, M, out, ldo);
    return;
  }
#endif
  q4_1_rows_scalar(wq, wd, wm, blocks, n0, n1, x, M, out, ldo);
}

void block_sums(const float* x, int blocks, int r0, int r1, float* xsum) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int b = 0; b < blocks; ++b) {
      const float* v = x + (r * blocks + b) * 32;
      float sum = 0.0f;
      for (int i = 0; i < 32; ++i) {
        sum += v[i];
      }
      xsum[r * blocks + b] = sum;
    }
  }
}

void q8_0_rows_f32(Isa isa, const int8_t* wq, const float* wd, int blocks, int n0, int n1, const float* x,
                   int M, float* out, int64_t ldo) {
#if FORKLINE_X86
  if (isa == Isa::avx2) {
    q8_0_rows_f32_avx2(wq, wd, blocks, n0, n1, x, M, out, ldo);
    return;
  }
#endif
  q8_0_rows_f32_scalar(wq, wd, blocks, n0, n1, x, M, out, ldo);
}

void q4_1_rows_f32(Isa isa, const uint8_t* wq, const float* wd, const float* wm, int blocks, int n0, int n1,
                   const float* x, const float* xsum, int M, float* out, int64_t ldo) {
#if FORKLINE_X86
  if (isa == Isa::avx2) {
    q4_1_rows_f32_avx2(wq, wd, wm, blocks, n0, n1, x, xsum, M, out, ldo);
    return;
  }
#endif
  q4_1_rows_f32_scalar(wq, wd, wm, blocks, n0, n1, x, xsum, M, out, ldo);
}

}  // namespace forkline
