#include "attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

#include "pool.h"
#include "qdot.h"

#include "common.h"
#include "vmath.h"

namespace forkline {

namespace {

// Most q heads per kv head scored together (they share each key and value load).
constexpr int kMaxGroup = 8;
// One thread's speed, for the pool's policy: multiply-adds (q heads x keys x head_dim) and key/value
// bytes per microsecond.
constexpr double kMacsPerUs = 4000.0;
constexpr double kBytesPerUs = 9000.0;
// Work split: whole units (row x kv head x group of q heads) when there are at least this many per
// thread, else (decode) each unit's chunks in about kRunsPerThread runs per thread; calls shorter than
// kSplitUs always go by units.
constexpr int kUnitsPerThread = 4;
constexpr int kRunsPerThread = 4;
constexpr double kSplitUs = 20.0;
// At most this many query rows in a group: chunk_partial fetches each chunk's value rows ahead, the
// keys scored kPrefetchKeys at a time.
constexpr int kPrefetchRows = 8;
constexpr int kPrefetchKeys = 8;

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("causal_attention: " + what);
}

using vmath::bits_float;
using vmath::exp_scalar;

// ---------------------------------------------------------------- key / value element types
//
// Keys and values are read in their stored type and widened to float on load (exactly: every float16
// and bfloat16 value is a float32 value), so a half-precision cache costs half the bytes and gives the
// bits of the float32 kernel run on the upcast values.

struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

inline float to_float(float v) {
  return v;
}
inline float to_float(BF16 v) {
  return bits_float(static_cast<uint32_t>(v.bits) << 16);
}
// IEEE half -> single, as F16C's vcvtph2ps: exact; subnormals normalized; a NaN keeps its payload
// and comes out quiet.
inline float to_float(F16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1F, mant = v.bits & 0x3FF;
  if (exp == 0x1F) {
    return bits_float(sign | 0x7F800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u));
  }
  if (exp == 0) {  // zero or subnormal: mant * 2**-24, exact in float
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return bits_float(sign | [&] {
      uint32_t b;
      std::memcpy(&b, &mag, sizeof(b));
      return b;
    }());
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// ---------------------------------------------------------------- kernels
//
// scores: s[r * ld + t] = scale * (q_r . k_t) for r < R, t < L. The dot product: lane j sums elements
//   d = 8b + j over blocks b in order (fma), reduce8, then the D % 8 tail elements in order (fma).
// exp_sum: e[t] = exp(s[t] - mx) for t < L, 0 for L <= t < ld; returns the sum: lane j adds e[8b + j]
//   over blocks b in order, then reduce8.
// pv: o_r = sum over t in order of e_r[t] * v_t (element-wise fma from 0).

struct Scalar {
  template <class T>
  static void scores(const float* const* q, int R, const T* const* k, int L, int D, float scale, float* s,
                     int ld) {
    const int D8 = D / 8 * 8;
    for (int t = 0; t < L; ++t) {
      for (int r = 0; r < R; ++r) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int b = 0; b < D8; b += 8) {
          for (int j = 0; j < 8; ++j) {
            acc[j] = std::fma(q[r][b + j], to_float(k[t][b + j]), acc[j]);
          }
        }
        float sum = reduce8(acc);
        for (int i = D8; i < D; ++i) {
          sum = std::fma(q[r][i], to_float(k[t][i]), sum);
        }
        s[r * ld + t] = sum * scale;
      }
    }
  }

  static float exp_sum(const float* s, int L, float mx_, float* e, int ld) {
    for (int t = 0; t < L; ++t) {
      e[t] = exp_scalar(s[t] - mx_);
    }
    std::fill(e + L, e + ld, 0.0f);
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int b = 0; b < ld; b += 8) {
      for (int j = 0; j < 8; ++j) {
        acc[j] = acc[j] + e[b + j];
      }
    }
    return reduce8(acc);
  }

  // max of s[0..ld) (ld % 8 == 0): lane j takes s[8b + j] over blocks b (x > m ? x : m), then the
  // lanes pair as reduce8 does.
  static float max8(const float* s, int ld) {
    float a[8];
    std::fill(a, a + 8, -std::numeric_limits<float>::infinity());
    for (int b = 0; b < ld; b += 8) {
      for (int j = 0; j < 8; ++j) {
        a[j] = s[b + j] > a[j] ? s[b + j] : a[j];
      }
    }
    auto mx2 = [](float x, float y) { return x > y ? x : y; };
    const float t0 = mx2(a[0], a[4]), t1 = mx2(a[1], a[5]), t2 = mx2(a[2], a[6]), t3 = mx2(a[3], a[7]);
    return mx2(mx2(t0, t2), mx2(t1, t3));
  }

  // O = fma(o, b, O * a) element-wise
  static void rescale_add(float* O, const float* o, int D, float a, float b) {
    for (int x = 0; x < D; ++x) {
      O[x] = std::fma(o[x], b, O[x] * a);
    }
  }

  template <class T>
  static void pv(float* o, int R, int D, const float* e, int ld, const T* const* v, int L) {
    std::fill(o, o + static_cast<int64_t>(R) * D, 0.0f);
    for (int t = 0; t < L; ++t) {
      for (int r = 0; r < R; ++r) {
        float* orow = o + static_cast<int64_t>(r) * D;
        const float w = e[r * ld + t];
        for (int i = 0; i < D; ++i) {
          orow[i] = std::fma(w, to_float(v[t][i]), orow[i]);
        }
      }
    }
  }
};

#if FORKLINE_X86

#define ATTN_FN __attribute__((target("avx2,fma,f16c")))

ATTN_FN FORKLINE_INLINE __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}
ATTN_FN FORKLINE_INLINE __m256 load8(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
ATTN_FN FORKLINE_INLINE __m256 load8(const BF16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

using vmath::exp_avx2;

// Kernels specialized on R (q heads sharing each key / value load) so their accumulators live in
// registers: scores takes two keys at a time (each q load serves both), pv holds B blocks of 8 output
// elements per head across the chunk's keys.
template <int R, class T>
ATTN_FN void scores_r(const float* const* q, const T* const* k, int L, int D, float scale, float* s, int ld) {
  const int D8 = D / 8 * 8;
  constexpr int KT = R <= 4 ? 2 : 1;
  auto tail = [&](const T* kt, int r, float sum) {
    for (int i = D8; i < D; ++i) {
      sum = std::fma(q[r][i], to_float(kt[i]), sum);
    }
    return sum * scale;
  };
  int t = 0;
  for (; t + KT <= L; t += KT) {
    __m256 acc[KT][R];
#pragma GCC unroll 8
    for (int x = 0; x < KT; ++x) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[x][r] = _mm256_setzero_ps();
      }
    }
    for (int b = 0; b < D8; b += 8) {
      __m256 kv[KT];
#pragma GCC unroll 8
      for (int x = 0; x < KT; ++x) {
        kv[x] = load8(k[t + x] + b);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256 qv = _mm256_loadu_ps(q[r] + b);
        // in a register for the KT keys, not folded into each FMA as a memory operand: on Zen 3 the
        // folded loop (one load per FMA) scored 4 heads of 256 at 0.7x the speed
        asm("" : "+x"(qv));
#pragma GCC unroll 8
        for (int x = 0; x < KT; ++x) {
          acc[x][r] = _mm256_fmadd_ps(qv, kv[x], acc[x][r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int x = 0; x < KT; ++x) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        s[r * ld + t + x] = tail(k[t + x], r, reduce8_avx2(acc[x][r]));
      }
    }
  }
  for (; t < L; ++t) {
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_setzero_ps();
    }
    for (int b = 0; b < D8; b += 8) {
      const __m256 kv = load8(k[t] + b);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + b), kv, acc[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      s[r * ld + t] = tail(k[t], r, reduce8_avx2(acc[r]));
    }
  }
}

template <int R, int B, class T>
ATTN_FN FORKLINE_INLINE void pv_blocks(float* o, int D, const float* e, int ld, const T* const* v, int L, int i) {
  __m256 acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int x = 0; x < B; ++x) {
      acc[r][x] = _mm256_setzero_ps();
    }
  }
  for (int t = 0; t < L; ++t) {
    __m256 vv[B];
#pragma GCC unroll 4
    for (int x = 0; x < B; ++x) {
      vv[x] = load8(v[t] + i + 8 * x);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 ev = _mm256_broadcast_ss(e + r * ld + t);
#pragma GCC unroll 4
      for (int x = 0; x < B; ++x) {
        acc[r][x] = _mm256_fmadd_ps(ev, vv[x], acc[r][x]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int x = 0; x < B; ++x) {
      _mm256_storeu_ps(o + static_cast<int64_t>(r) * D + i + 8 * x, acc[r][x]);
    }
  }
}

template <int R, class T>
ATTN_FN void pv_r(float* o, int D, const float* e, int ld, const T* const* v, int L) {
  constexpr int B = R <= 2 ? 4 : R <= 4 ? 3 : R <= 6 ? 2 : 1;  // R * B <= 12 accumulators
  const int D8 = D / 8 * 8;
  int i = 0;
  for (; i + 8 * B <= D8; i += 8 * B) {
    pv_blocks<R, B>(o, D, e, ld, v, L, i);
  }
  for (; i < D8; i += 8) {
    pv_blocks<R, 1>(o, D, e, ld, v, L, i);
  }
  for (int r = 0; r < R; ++r) {
    std::fill(o + static_cast<int64_t>(r) * D + D8, o + static_cast<int64_t>(r + 1) * D, 0.0f);
  }
  for (int x = D8; x < D; ++x) {
    for (int t = 0; t < L; ++t) {
      for (int r = 0; r < R; ++r) {
        float& y = o[static_cast<int64_t>(r) * D + x];
        y = std::fma(e[r * ld + t], to_float(v[t][x]), y);
      }
    }
  }
}

struct Avx2 {
  template <class T>
  static void scores(const float* const* q, int R, const T* const* k, int L, int D, float scale, float* s,
                     int ld) {
    switch (R) {
      case 1: return scores_r<1>(q, k, L, D, scale, s, ld);
      case 2: return scores_r<2>(q, k, L, D, scale, s, ld);
      case 3: return scores_r<3>(q, k, L, D, scale, s, ld);
      case 4: return scores_r<4>(q, k, L, D, scale, s, ld);
      case 5: return scores_r<5>(q, k, L, D, scale, s, ld);
      case 6: return scores_r<6>(q, k, L, D, scale, s, ld);
      case 7: return scores_r<7>(q, k, L, D, scale, s, ld);
      default: return scores_r<8>(q, k, L, D, scale, s, ld);
    }
  }

  ATTN_FN static float max8(const float* s, int ld) {
    __m256 a = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int b = 0; b < ld; b += 8) {
      a = _mm256_max_ps(_mm256_loadu_ps(s + b), a);  // s > a ? s : a
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));  // t_j = max(a_j, a_j+4)
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));  // max(t0, t2), max(t1, t3)
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
  }

  ATTN_FN static void rescale_add(float* O, const float* o, int D, float a, float b) {
    const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
    int x = 0;
    for (; x + 8 <= D; x += 8) {
      _mm256_storeu_ps(O + x, _mm256_fmadd_ps(_mm256_loadu_ps(o + x), bv, _mm256_mul_ps(_mm256_loadu_ps(O + x), av)));
    }
    for (; x < D; ++x) {
      O[x] = std::fma(o[x], b, O[x] * a);
    }
  }

  ATTN_FN static float exp_sum(const float* s, int L, float mx_, float* e, int ld) {
    const __m256 m = _mm256_set1_ps(mx_);
    int t = 0;
    for (; t + 8 <= L; t += 8) {
      _mm256_storeu_ps(e + t, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), m)));
    }
    if (t < L) {  // the tail through a padded block (lanes past L are zeroed below)
      float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::memcpy(tmp, s + t, sizeof(float) * (L - t));
      _mm256_storeu_ps(tmp, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(tmp), m)));
      std::memcpy(e + t, tmp, sizeof(float) * (L - t));
    }
    std::fill(e + L, e + ld, 0.0f);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < ld; b += 8) {
      acc = _mm256_add_ps(acc, _mm256_loadu_ps(e + b));
    }
    return reduce8_avx2(acc);
  }

  template <class T>
  static void pv(float* o, int R, int D, const float* e, int ld, const T* const* v, int L) {
    switch (R) {
      case 1: return pv_r<1>(o, D, e, ld, v, L);
      case 2: return pv_r<2>(o, D, e, ld, v, L);
      case 3: return pv_r<3>(o, D, e, ld, v, L);
      case 4: return pv_r<4>(o, D, e, ld, v, L);
      case 5: return pv_r<5>(o, D, e, ld, v, L);
      case 6: return pv_r<6>(o, D, e, ld, v, L);
      case 7: return pv_r<7>(o, D, e, ld, v, L);
      default: return pv_r<8>(o, D, e, ld, v, L);
    }
  }
};


// AVX-512 (the avx512 ISA level): the same arithmetic as the AVX2 kernels, bit for bit, with fewer
// instructions per key. scores: 4 keys x R heads of accumulators (each key load serves R heads, each q
// load 4 keys) and the 8-lane sums of 4 keys done together by a transposed tree that adds exactly the
// pairs reduce8 adds; pv: 16-float registers, so a head's 64 values need 4 accumulators and one pass
// over the chunk's keys holds R heads (each output element is still fma over the keys in order).
#define ATTN512_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw")))

ATTN512_FN FORKLINE_INLINE __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
ATTN512_FN FORKLINE_INLINE __m512 load16(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
ATTN512_FN FORKLINE_INLINE __m512 load16(const BF16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// The 8-lane sums of four accumulators, each as reduce8 ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)),
// returned as [s0, s1, s2, s3].
ATTN512_FN FORKLINE_INLINE __m128 reduce8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  // t = lo + hi of each: [t0 t1 t2 t3] with t_j = a_j + a_{j+4}
  const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  // u0 = t0 + t2, u1 = t1 + t3: [u0^0 u1^0 u0^2 u1^2 | u0^1 u1^1 u0^3 u1^3]
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44), _mm256_shuffle_ps(s01, s23, 0xEE));
  // s = u0 + u1: [s0 s2 . . | s1 s3 . .]
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u, u, 0x88), _mm256_shuffle_ps(u, u, 0xDD));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

template <int R, class T>
ATTN512_FN void scores4_r(const float* const* q, const T* const* k, int L, int D, float scale, float* s, int ld) {
  const __m128 sc = _mm_set1_ps(scale);
  int t = 0;
  for (; t + 4 <= L; t += 4) {
    __m256 acc[R][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) {
        acc[r][x] = _mm256_setzero_ps();
      }
    }
    for (int b = 0; b < D; b += 8) {
      __m256 kv[4];
#pragma GCC unroll 4
      for (int x = 0; x < 4; ++x) {
        kv[x] = load8(k[t + x] + b);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + b);
#pragma GCC unroll 4
        for (int x = 0; x < 4; ++x) {
          acc[r][x] = _mm256_fmadd_ps(qv, kv[x], acc[r][x]);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_storeu_ps(s + r * ld + t, _mm_mul_ps(reduce8x4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), sc));
    }
  }
  if (t < L) {  // the last keys one at a time, as the AVX2 kernel does them
    scores_r<R>(q, k + t, L - t, D, scale, s + t, ld);
  }
}

template <int R, int B, class T>
ATTN512_FN FORKLINE_INLINE void pv16_blocks(float* o, int D, const float* e, int ld, const T* const* v, int L,
                                            int i) {
  __m512 acc[R][B];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int x = 0; x < B; ++x) {
      acc[r][x] = _mm512_setzero_ps();
    }
  }
  for (int t = 0; t < L; ++t) {
    __m512 vv[B];
#pragma GCC unroll 8
    for (int x = 0; x < B; ++x) {
      vv[x] = load16(v[t] + i + 16 * x);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 ev = _mm512_set1_ps(e[r * ld + t]);
#pragma GCC unroll 8
      for (int x = 0; x < B; ++x) {
        acc[r][x] = _mm512_fmadd_ps(ev, vv[x], acc[r][x]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int x = 0; x < B; ++x) {
      _mm512_storeu_ps(o + static_cast<int64_t>(r) * D + i + 16 * x, acc[r][x]);
    }
  }
}

template <int R, class T>
ATTN512_FN void pv16_r(float* o, int D, const float* e, int ld, const T* const* v, int L) {
  constexpr int B = R <= 2 ? 8 : R <= 6 ? 4 : 3;  // R * B <= 24 accumulators of 16 floats
  const int D16 = D / 16 * 16;
  int i = 0;
  for (; i + 16 * B <= D16; i += 16 * B) {
    pv16_blocks<R, B>(o, D, e, ld, v, L, i);
  }
  for (; i < D16; i += 16) {
    pv16_blocks<R, 1>(o, D, e, ld, v, L, i);
  }
  if (i < D) {  // the last D % 16 elements: 8-float blocks and the scalar tail, as the AVX2 kernel
    for (; i + 8 <= D; i += 8) {
      pv_blocks<R, 1>(o, D, e, ld, v, L, i);
    }
    for (int r = 0; r < R; ++r) {
      std::fill(o + static_cast<int64_t>(r) * D + i, o + static_cast<int64_t>(r + 1) * D, 0.0f);
    }
    for (int x = i; x < D; ++x) {
      for (int t = 0; t < L; ++t) {
        for (int r = 0; r < R; ++r) {
          float& y = o[static_cast<int64_t>(r) * D + x];
          y = std::fma(e[r * ld + t], to_float(v[t][x]), y);
        }
      }
    }
  }
}

struct Avx512 : Avx2 {
  template <class T>
  static void scores(const float* const* q, int R, const T* const* k, int L, int D, float scale, float* s,
                     int ld) {
    if (D % 8 != 0) {  // a tail per key: the AVX2 kernel
      return Avx2::scores(q, R, k, L, D, scale, s, ld);
    }
    switch (R) {
      case 1: return scores4_r<1>(q, k, L, D, scale, s, ld);
      case 2: return scores4_r<2>(q, k, L, D, scale, s, ld);
      case 3: return scores4_r<3>(q, k, L, D, scale, s, ld);
      case 4: return scores4_r<4>(q, k, L, D, scale, s, ld);
      default: return Avx2::scores(q, R, k, L, D, scale, s, ld);
    }
  }

  template <class T>
  static void pv(float* o, int R, int D, const float* e, int ld, const T* const* v, int L) {
    switch (R) {
      case 1: return pv16_r<1>(o, D, e, ld, v, L);
      case 2: return pv16_r<2>(o, D, e, ld, v, L);
      case 3: return pv16_r<3>(o, D, e, ld, v, L);
      case 4: return pv16_r<4>(o, D, e, ld, v, L);
      case 5: return pv16_r<5>(o, D, e, ld, v, L);
      case 6: return pv16_r<6>(o, D, e, ld, v, L);
      case 7: return pv16_r<7>(o, D, e, ld, v, L);
      default: return pv16_r<8>(o, D, e, ld, v, L);
    }
  }
};

#endif

// Everything one call reads, resolved on the CPU task: visible keys sorted by position.
struct Plan {
  int n = 0, hq = 0, hkv = 0, d = 0, rep = 0, window = 0, chunk = 0;
  float scale = 0.0f;
  const float* q = nullptr;
  int64_t qs0 = 0, qs1 = 0;  // q(i, h, :) = q + i * qs0 + h * qs1
  std::vector<int32_t> qpos;  // [n]
  std::vector<int32_t> pos;  // sorted positions of the readable keys
  struct Row {
    const char* k;  // the key's row at kv head 0 (stored type)
    const char* v;
    int part;  // for the kv-head strides
  };
  std::vector<Row> rows;  // per sorted key
  std::vector<int64_t> khs, vhs;  // per part: kv-head stride (elements)
  float* out = nullptr;  // [n, hq, d]

  int groups() const {
    return (rep + kMaxGroup - 1) / kMaxGroup;
  }
  // The sorted keys query row i sees: [j0, j1).
  void visible(int i, int& j0, int& j1) const {
    const int p = qpos[i];
    const int lo = window > 0 ? std::max(0, p - window + 1) : 0;
    const int total = static_cast<int>(pos.size());
    j0 = p < 0 ? 0 : static_cast<int>(std::lower_bound(pos.data(), pos.data() + total, lo) - pos.data());
    j1 = p < 0 ? 0 : static_cast<int>(std::upper_bound(pos.data(), pos.data() + total, p) - pos.data());
  }
  // The end of the chunk (absolute positions [c * chunk, (c + 1) * chunk)) holding sorted key j < j1.
  int chunk_end(int j, int j1) const {
    const int64_t boundary = (static_cast<int64_t>(pos[j]) / chunk + 1) * chunk;
    if (boundary > std::numeric_limits<int32_t>::max()) {
      return j1;
    }
    return static_cast<int>(std::lower_bound(pos.data() + j, pos.data() + j1, static_cast<int32_t>(boundary)) -
                            pos.data());
  }
};

// One unit of work: query row i, kv head g, its q heads g * rep + h0 .. + R - 1.
struct Unit {
  int i, g, h0, R;
};

Unit unit_of(const Plan& P, int u) {
  const int groups = P.groups();
  const int gi = u % groups, ig = u / groups;
  const int h0 = gi * kMaxGroup;
  return {ig / P.hkv, ig % P.hkv, h0, std::min(kMaxGroup, P.rep - h0)};
}

struct Scratch {
  std::vector<const void*> kp, vp;
  std::vector<float> s, e, o, acc;
};

// A chunk's partial softmax for R q heads over sorted keys [j, je): m[r] = max score, l[r] = sum of
// e = exp(score - m[r]), o[r * D ..] = sum of e * v (the kernels' orders).
template <class K, class T>
void chunk_partial(const Plan& P, const Unit& u, int j, int je, Scratch& w, float* m, float* l, float* o) {
  const int D = P.d, R = u.R, L = je - j;
  const int ld = (L + 7) / 8 * 8;
  const float* q[kMaxGroup];
  for (int r = 0; r < R; ++r) {
    q[r] = P.q + u.i * P.qs0 + static_cast<int64_t>(u.g * P.rep + u.h0 + r) * P.qs1;
  }
  w.kp.resize(L);
  w.vp.resize(L);
  for (int t = 0; t < L; ++t) {
    const Plan::Row& row = P.rows[j + t];
    w.kp[t] = reinterpret_cast<const T*>(row.k) + u.g * P.khs[row.part];
    w.vp[t] = reinterpret_cast<const T*>(row.v) + u.g * P.vhs[row.part];
  }
  w.s.resize(static_cast<size_t>(R) * ld);
  w.e.resize(static_cast<size_t>(R) * ld);
  const T* const* kp = reinterpret_cast<const T* const*>(w.kp.data());
  if (P.n > kPrefetchRows) {  // many rows read each key: the keys and values stay in cache between them
    K::scores(q, R, kp, L, D, P.scale, w.s.data(), ld);
  } else {
    // Decode: the keys and values come from memory once. A few keys are scored at a time while their
    // value rows are fetched: pv reads a value row in several passes of a few lines each, and each
    // pass would otherwise wait on its lines (Gemma 3's 512-byte rows: 0.76-0.84x the time at 513 to
    // 4,096 keys streamed). A key's score does not depend on which keys share its call.
    const int64_t row_bytes = static_cast<int64_t>(D) * sizeof(T);
    for (int t0 = 0; t0 < L; t0 += kPrefetchKeys) {
      const int n = std::min(kPrefetchKeys, L - t0);
      for (int t = t0; t < t0 + n; ++t) {
        for (int64_t b = 0; b < row_bytes; b += 64) {
          __builtin_prefetch(static_cast<const char*>(w.vp[t]) + b, 0, 3);
        }
      }
      K::scores(q, R, kp + t0, n, D, P.scale, w.s.data() + t0, ld);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* s = w.s.data() + r * ld;
    std::fill(s + L, s + ld, -std::numeric_limits<float>::infinity());
    m[r] = K::max8(s, ld);
    l[r] = K::exp_sum(s, L, m[r], w.e.data() + r * ld, ld);
  }
  K::pv(o, R, D, w.e.data(), ld, reinterpret_cast<const T* const*>(w.vp.data()), L);
}

// Merges a chunk's partial into the running (M, Lsum, O) of R q heads: the canonical fold, in
// ascending chunk order whoever computed the partials. M starts at -inf, Lsum and O at 0 (the first
// chunk's partial then comes out exactly).
template <class K>
void fold(int R, int D, float* M, float* Lsum, float* O, const float* m, const float* l, const float* o) {
  for (int r = 0; r < R; ++r) {
    const float mn = m[r] > M[r] ? m[r] : M[r];
    const float a = exp_scalar(M[r] - mn), b = exp_scalar(m[r] - mn);
    M[r] = mn;
    Lsum[r] = std::fma(l[r], b, Lsum[r] * a);
    K::rescale_add(O + static_cast<int64_t>(r) * D, o + static_cast<int64_t>(r) * D, D, a, b);
  }
}

void finish(const Plan& P, const Unit& u, const float* Lsum, const float* O) {
  const int D = P.d;
  for (int r = 0; r < u.R; ++r) {
    float* dst = P.out + (static_cast<int64_t>(u.i) * P.hq + u.g * P.rep + u.h0 + r) * D;
    const float* src = O + static_cast<int64_t>(r) * D;
    for (int x = 0; x < D; ++x) {
      dst[x] = src[x] / Lsum[r];  // no key: 0 / 0 = NaN
    }
  }
}

// A whole unit on one thread: each chunk's partial folded in as it is computed.
template <class K, class T>
void attend_unit(const Plan& P, const Unit& u, Scratch& w) {
  int j0, j1;
  P.visible(u.i, j0, j1);
  const int D = P.d, R = u.R;
  float M[kMaxGroup], Lsum[kMaxGroup], m[kMaxGroup], l[kMaxGroup];
  std::fill(M, M + R, -std::numeric_limits<float>::infinity());
  std::fill(Lsum, Lsum + R, 0.0f);
  w.acc.assign(static_cast<size_t>(R) * D, 0.0f);
  w.o.resize(static_cast<size_t>(R) * D);
  for (int j = j0; j < j1;) {
    const int je = P.chunk_end(j, j1);
    chunk_partial<K, T>(P, u, j, je, w, m, l, w.o.data());
    fold<K>(R, D, M, Lsum, w.acc.data(), m, l, w.o.data());
    j = je;
  }
  finish(P, u, Lsum, w.acc.data());
}

// The kernels for an ISA and a key/value type.
struct Kernels {
  void (*unit)(const Plan&, const Unit&, Scratch&);
  void (*partial)(const Plan&, const Unit&, int, int, Scratch&, float*, float*, float*);
  void (*fold)(int, int, float*, float*, float*, const float*, const float*, const float*);
};

template <class K, class T>
constexpr Kernels kernels_for() {
  return {&attend_unit<K, T>, &chunk_partial<K, T>, &fold<K>};
}

Kernels pick(Isa isa, mx::Dtype kv) {
  const int t = kv == mx::float16 ? 1 : kv == mx::bfloat16 ? 2 : 0;
#if FORKLINE_X86
  if (isa == Isa::avx512) {
    return t == 1 ? kernels_for<Avx512, F16>()
         : t == 2 ? kernels_for<Avx512, BF16>()
                  : kernels_for<Avx512, float>();
  }
  if (isa != Isa::scalar) {
    return t == 1 ? kernels_for<Avx2, F16>() : t == 2 ? kernels_for<Avx2, BF16>() : kernels_for<Avx2, float>();
  }
#endif
  return t == 1 ? kernels_for<Scalar, F16>() : t == 2 ? kernels_for<Scalar, BF16>() : kernels_for<Scalar, float>();
}

// A [A, B, C] array with a unit last stride: the array itself or a dense copy held in `copy`.
template <class T>
const void* dense3(const mx::array& a, std::vector<char>& copy, int64_t& s0, int64_t& s1) {
  const auto& st = a.strides();
  const T* src = a.data<T>();
  if (st[2] == 1) {
    s0 = st[0];
    s1 = st[1];
    return src;
  }
  const int64_t A = a.shape(0), B = a.shape(1), C = a.shape(2);
  copy.resize(static_cast<size_t>(A * B * C) * sizeof(T));
  T* dst = reinterpret_cast<T*>(copy.data());
  for (int64_t x = 0; x < A; ++x) {
    for (int64_t y = 0; y < B; ++y) {
      for (int64_t z = 0; z < C; ++z) {
        dst[(x * B + y) * C + z] = src[x * st[0] + y * st[1] + z * st[2]];
      }
    }
  }
  s0 = B * C;
  s1 = C;
  return dst;
}

const void* dense3_any(const mx::array& a, std::vector<char>& copy, int64_t& s0, int64_t& s1) {
  if (a.dtype() == mx::float32) {
    return dense3<float>(a, copy, s0, s1);
  }
  return dense3<uint16_t>(a, copy, s0, s1);  // float16 / bfloat16: moved as 16-bit words
}

}  // namespace

std::vector<int> checked_groups(const char* op, const std::vector<std::tuple<int, int, int>>& groups, int rows,
                                size_t parts) {
  std::vector<int> spec;
  if (groups.empty()) {
    return spec;
  }
  int row = 0;
  size_t part_count = 0;
  for (const auto& [r0, r1, np] : groups) {
    if (r0 != row || r1 <= r0 || np < 1) {
      throw std::invalid_argument(std::string(op) +
                                  ": groups must be (row_start, row_stop, parts) covering the rows in order, each "
                                  "with >= 1 part");
    }
    row = r1;
    part_count += np;
    spec.insert(spec.end(), {r0, r1, np});
  }
  if (row != rows || part_count != parts) {
    throw std::invalid_argument(std::string(op) + ": groups must cover all " + std::to_string(rows) +
                                " rows and all " + std::to_string(parts) + " parts");
  }
  return spec;
}

mx::array causal_attention(const mx::array& q, const mx::array& q_pos, const std::vector<mx::array>& keys,
                           const std::vector<mx::array>& values, const std::vector<mx::array>& key_pos,
                           float scale, int window, int chunk, const std::vector<std::tuple<int, int, int>>& groups,
                           mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    bad("CPU streams only");
  }
  if (q.ndim() != 3) {
    bad("q must be [n, q_heads, head_dim], got " + shape_str(q));
  }
  const int n = q.shape(0), hq = q.shape(1), d = q.shape(2);
  if (q_pos.ndim() != 1 || q_pos.shape(0) != n || !mx::issubdtype(q_pos.dtype(), mx::integer)) {
    bad("q_pos must be an int array [" + std::to_string(n) + "], got " + shape_str(q_pos));
  }
  if (keys.empty() || keys.size() != values.size() || keys.size() != key_pos.size()) {
    bad("keys, values and key_pos must be lists of one length >= 1");
  }
  if (window < 0 || chunk < 1) {
    bad("window must be >= 0 and chunk >= 1");
  }
  std::vector<int> spec = checked_groups("causal_attention", groups, n, keys.size());
  if (!mx::issubdtype(q.dtype(), mx::floating)) {
    bad("q must be a floating-point array");
  }
  const int hkv = keys[0].ndim() == 3 ? keys[0].shape(0) : 0;
  if (hkv < 1 || hq % hkv != 0) {
    bad("q heads (" + std::to_string(hq) + ") must be a multiple of kv heads, keys " + shape_str(keys[0]));
  }
  // Keys and values are read in their own type when every part has the same one of float32 / float16
  // / bfloat16; otherwise (mixed or other types) all are converted to float32 first.
  mx::Dtype kv = keys[0].dtype();
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i].dtype() != kv || values[i].dtype() != kv) {
      kv = mx::float32;
    }
  }
  if (kv != mx::float16 && kv != mx::bfloat16) {
    kv = mx::float32;
  }
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, stream), mx::astype(q_pos, mx::int32, stream)};
  for (size_t i = 0; i < keys.size(); ++i) {
    const mx::array &k = keys[i], &v = values[i], &kp = key_pos[i];
    if (k.ndim() != 3 || k.shape(0) != hkv || k.shape(2) != d || k.shape() != v.shape()) {
      bad("keys/values must be [" + std::to_string(hkv) + ", S, " + std::to_string(d) + "], got " +
          shape_str(k) + " / " + shape_str(v));
    }
    if (!mx::issubdtype(k.dtype(), mx::floating) || !mx::issubdtype(v.dtype(), mx::floating)) {
      bad("keys/values must be floating-point arrays");
    }
    if (kp.ndim() != 1 || kp.shape(0) != k.shape(1) || !mx::issubdtype(kp.dtype(), mx::integer)) {
      bad("key_pos must be an int array [" + std::to_string(k.shape(1)) + "], got " + shape_str(kp));
    }
    inputs.push_back(mx::astype(kp, mx::int32, stream));
    inputs.push_back(mx::astype(k, kv, stream));  // no copy when k already has that type
    inputs.push_back(mx::astype(v, kv, stream));
  }
  return mx::array({n, hq, d}, mx::float32,
                   std::make_shared<CausalAttention>(stream, scale, window, chunk, std::move(spec)), std::move(inputs));
}

void CausalAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // The task holds its own references to the arrays until it has run.
  encoder.dispatch([inputs, out, scale = scale_, window = window_, chunk = chunk_, groups = groups_]() mutable {
    attention_run(inputs, out.data<float>(), scale, window, chunk, groups);
  });
}

void attention_run(const std::vector<mx::array>& inputs, float* out_data, float scale, int window, int chunk,
                   const std::vector<int>& groups) {
  const mx::array& q = inputs[0];
  const int n = q.shape(0), hq = q.shape(1), d = q.shape(2), hkv = inputs[3].shape(0);
  if (n == 0 || hq == 0 || d == 0) {
    return;
  }
  std::vector<char> qcopy;
  int64_t qs0, qs1;
  const float* qbase = static_cast<const float*>(dense3<float>(q, qcopy, qs0, qs1));
  const int32_t* qp = inputs[1].data<int32_t>();
  const size_t parts = (inputs.size() - 2) / 3;
  const mx::Dtype kv = inputs[3].dtype();
  const int64_t elem = kv == mx::float32 ? 4 : 2;
  // every part's keys and values with a unit last stride (copies only for strided views)
  std::vector<std::vector<char>> copies(2 * parts);
  std::vector<int64_t> khs(parts), vhs(parts), ks1(parts), vs1(parts);
  std::vector<const char*> kb(parts), vb(parts);
  for (size_t part = 0; part < parts; ++part) {
    kb[part] = static_cast<const char*>(dense3_any(inputs[3 + 3 * part], copies[2 * part], khs[part], ks1[part]));
    vb[part] = static_cast<const char*>(dense3_any(inputs[4 + 3 * part], copies[2 * part + 1], vhs[part], vs1[part]));
  }
  // One plan per group of rows (a sequence's rows and the parts of its view; by default one group:
  // every row reads every part). A row's result never depends on the grouping.
  const std::vector<int> one{0, n, static_cast<int>(parts)};
  const std::vector<int>& spec = groups.empty() ? one : groups;
  const int ngroups = static_cast<int>(spec.size() / 3);
  struct Group {
    Plan P;
    std::vector<int> j0, j1;
    int unit0 = 0, units = 0;
  };
  std::vector<Group> gs(ngroups);
  int64_t keys_read = 0;
  int units = 0;
  size_t part0 = 0;
  for (int g = 0; g < ngroups; ++g) {
    const int r0 = spec[3 * g], r1 = spec[3 * g + 1], np = spec[3 * g + 2];
    Plan& P = gs[g].P;
    P.n = r1 - r0;
    P.hq = hq;
    P.d = d;
    P.hkv = hkv;
    P.rep = hq / hkv;
    P.window = window;
    P.chunk = chunk;
    P.scale = scale;
    P.out = out_data + static_cast<int64_t>(r0) * hq * d;
    P.q = qbase + r0 * qs0;
    P.qs0 = qs0;
    P.qs1 = qs1;
    P.qpos.resize(P.n);
    for (int i = 0; i < P.n; ++i) {
      P.qpos[i] = qp[(r0 + i) * inputs[1].strides()[0]];
    }
    P.khs = khs;
    P.vhs = vhs;
    // every readable key (position >= 0) of the group's parts, then sorted by position (stable: a
    // caller's duplicate positions at least keep one order)
    size_t total = 0;
    for (size_t part = part0; part < part0 + np; ++part) {
      total += inputs[2 + 3 * part].shape(0);
    }
    P.pos.reserve(total);
    P.rows.reserve(total);
    for (size_t part = part0; part < part0 + np; ++part) {
      const mx::array& kp = inputs[2 + 3 * part];
      const int32_t* kpp = kp.data<int32_t>();
      const int64_t kst = kp.strides()[0];
      for (int row = 0; row < kp.shape(0); ++row) {
        const int32_t pp = kpp[row * kst];
        if (pp >= 0) {
          P.pos.push_back(pp);
          P.rows.push_back({kb[part] + row * ks1[part] * elem, vb[part] + row * vs1[part] * elem,
                            static_cast<int>(part)});
        }
      }
    }
    part0 += np;
    if (!std::is_sorted(P.pos.begin(), P.pos.end())) {
      std::vector<int> order(P.pos.size());
      for (size_t j = 0; j < order.size(); ++j) {
        order[j] = static_cast<int>(j);
      }
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return P.pos[a] < P.pos[b]; });
      std::vector<int32_t> pos(order.size());
      std::vector<Plan::Row> rows(order.size());
      for (size_t j = 0; j < order.size(); ++j) {
        pos[j] = P.pos[order[j]];
        rows[j] = P.rows[order[j]];
      }
      P.pos.swap(pos);
      P.rows.swap(rows);
    }
    // the keys each row reads, for the work estimate and the split
    gs[g].j0.resize(P.n);
    gs[g].j1.resize(P.n);
    for (int i = 0; i < P.n; ++i) {
      P.visible(i, gs[g].j0[i], gs[g].j1[i]);
      keys_read += gs[g].j1[i] - gs[g].j0[i];
    }
    gs[g].unit0 = units;
    gs[g].units = P.n * P.hkv * P.groups();
    units += gs[g].units;
  }
  // global unit u -> (its group, the unit within it)
  auto locate = [&](int u, int& g) {
    g = 0;
    while (g + 1 < ngroups && gs[g + 1].unit0 <= u) {
      ++g;
    }
    return u - gs[g].unit0;
  };
  const Kernels K = pick(active_isa(), kv);
  WorkerPool& workers = pool();
  const double est_us = static_cast<double>(keys_read) * hq * d / kMacsPerUs +
                        static_cast<double>(keys_read) * hkv * d * 2 * elem / kBytesPerUs;
  if (workers.size() == 1 || est_us < kSplitUs || units >= kUnitsPerThread * workers.size()) {
    // whole units (each folds its chunks as it goes), shared out in small blocks
    const int block = std::max(1, units / (workers.size() * 8));
    workers.run_estimated((units + block - 1) / block, est_us, [&](int task) {
      thread_local Scratch w;  // the running thread's own
      for (int u = task * block; u < std::min(units, (task + 1) * block); ++u) {
        int g;
        const int local = locate(u, g);
        K.unit(gs[g].P, unit_of(gs[g].P, local), w);
      }
    });
    return;
  }
  // Few units (decode): every unit's chunks are split into runs that any thread computes, each
  // chunk's partial stored; then each unit folds its partials in ascending chunk order -- the same
  // operations as a whole unit on one thread.
  struct Run {
    int group, unit, first, j, je;  // first: the run's first chunk index (global)
  };
  std::vector<int> unit_chunk0(units + 1);  // unit u's chunks: [unit_chunk0[u], unit_chunk0[u + 1])
  std::vector<int> starts;
  for (int u = 0; u < units; ++u) {
    int g;
    const int local = locate(u, g);
    const Plan& P = gs[g].P;
    const Unit ul = unit_of(P, local);
    unit_chunk0[u] = static_cast<int>(starts.size());
    for (int j = gs[g].j0[ul.i]; j < gs[g].j1[ul.i]; j = P.chunk_end(j, gs[g].j1[ul.i])) {
      starts.push_back(j);
    }
  }
  unit_chunk0[units] = static_cast<int>(starts.size());
  const int chunks = unit_chunk0[units];
  const int per = std::max(1, chunks / (workers.size() * kRunsPerThread));
  std::vector<Run> runs;
  for (int u = 0; u < units; ++u) {
    int g;
    const int local = locate(u, g);
    const int i = unit_of(gs[g].P, local).i;
    for (int c = unit_chunk0[u]; c < unit_chunk0[u + 1]; c += per) {
      const int ce = std::min(unit_chunk0[u + 1], c + per);
      runs.push_back({g, local, c, starts[c], ce < unit_chunk0[u + 1] ? starts[ce] : gs[g].j1[i]});
    }
  }
  const int D = d;
  const int stride = kMaxGroup * (D + 2);  // one chunk's partial: m[R], l[R], o[R * D]
  std::vector<float> partials(static_cast<size_t>(chunks) * stride);
  workers.run_estimated(static_cast<int>(runs.size()), est_us, [&](int task) {
    thread_local Scratch w;
    const Run& run = runs[task];
    const Plan& P = gs[run.group].P;
    const Unit u = unit_of(P, run.unit);
    const std::vector<int>& j1 = gs[run.group].j1;
    int c = run.first;
    for (int j = run.j; j < run.je; ++c) {
      const int je = P.chunk_end(j, j1[u.i]);
      float* part = partials.data() + static_cast<size_t>(c) * stride;
      K.partial(P, u, j, je, w, part, part + kMaxGroup, part + 2 * kMaxGroup);
      j = je;
    }
  });
  std::vector<float> O(static_cast<size_t>(kMaxGroup) * D);
  for (int u = 0; u < units; ++u) {
    int g;
    const int local = locate(u, g);
    const Unit un = unit_of(gs[g].P, local);
    float M[kMaxGroup], Lsum[kMaxGroup];
    std::fill(M, M + un.R, -std::numeric_limits<float>::infinity());
    std::fill(Lsum, Lsum + un.R, 0.0f);
    std::fill(O.begin(), O.end(), 0.0f);
    for (int c = unit_chunk0[u]; c < unit_chunk0[u + 1]; ++c) {
      const float* part = partials.data() + static_cast<size_t>(c) * stride;
      K.fold(un.R, D, M, Lsum, O.data(), part, part + kMaxGroup, part + 2 * kMaxGroup);
    }
    finish(gs[g].P, un, Lsum, O.data());
  }
}

void CausalAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("ForklineCausalAttention has no GPU implementation");
}

std::vector<mx::Shape> CausalAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool CausalAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CausalAttention&>(other);
  return scale_ == o.scale_ && window_ == o.window_ && chunk_ == o.chunk_ && groups_ == o.groups_;
}

}  // namespace forkline
