// Elementwise math the kernels share, each with a scalar and an AVX2 version that agree bit for bit:
// e**x from multiplies, adds and bit operations (no libm), and the float -> float16 / bfloat16 roundings.
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace forkline {
namespace vmath {

// e**x as 2**n * e**r (n = round(x / ln 2), Cody-Waite reduction, degree-7 Taylor polynomial): only
// multiplies, adds and bit operations, so the scalar and AVX2 versions agree bit for bit. x < -87
// gives exactly 0 (masked or negligible weights; also e**-inf), x is clamped at 88.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2**23: (v + kRound) - kRound rounds v to an integer
constexpr float kLn2Hi = 0.693359375f;  // n * kLn2Hi is exact for |n| <= 127
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;
constexpr float kC[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// The same operations as the AVX2 version, lane by lane (max/min keep _mm256_max_ps's operand order).
inline float exp_scalar(float x) {
  const bool under = x < kExpLo;
  float xc = x > kExpLo ? x : kExpLo;
  xc = xc < kExpHi ? xc : kExpHi;
  const float t = xc * kLog2e;
  const float n = (t + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = kC[7];
  for (int i = 6; i >= 0; --i) {
    p = p * r + kC[i];
  }
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? 0.0f : p * scale;
}

// Round to nearest even, as MLX's astype and F16C's vcvtps2ph (NaN -> a quiet NaN).
inline uint16_t float_to_half(float f) {
  uint32_t u = float_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= (127u + 16u) << 23) {  // |f| >= 65536 (Inf, NaN or overflow)
    o = u > 0x7F800000u ? 0x7E00 : 0x7C00;
  } else if (u < 113u << 23) {  // the half is subnormal or zero: align its 10 bits with an add
    const float magic = bits_float(((127u - 15u) + (23u - 10u) + 1u) << 23);
    o = static_cast<uint16_t>(float_bits(bits_float(u) + magic) - float_bits(magic));
  } else {
    const uint32_t odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd;
    o = static_cast<uint16_t>(u >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

inline uint16_t float_to_bfloat(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if FORKLINE_X86
#define VMATH_FN __attribute__((target("avx2,fma")))

VMATH_FN inline __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLo);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kExpHi));
  const __m256 t = _mm256_mul_ps(xc, _mm256_set1_ps(kLog2e));
  const __m256 rnd = _mm256_set1_ps(kRound);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(t, rnd), rnd);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(kLn2Hi))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(kLn2Lo)));
  __m256 p = _mm256_set1_ps(kC[7]);
  for (int i = 6; i >= 0; --i) {
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kC[i]));
  }
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#endif

}  // namespace vmath
}  // namespace forkline
