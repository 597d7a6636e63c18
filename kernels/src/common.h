// What the kernels' sources share: the x86 AVX2 function attribute (AVX2 code is compiled per function
// and chosen at run time, so one binary runs on any x86-64), the fixed 8-lane reduction and a shape
// formatter for error messages.
#pragma once

#include <cstdint>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include "mlx/array.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define FORKLINE_X86 1
#define AVX2_FN __attribute__((target("avx2,fma")))
// The same AVX2 arithmetic compiled with AVX-512VL's 32 vector registers (EVEX encodings of the same
// 256-bit operations: bitwise equal results, fewer reloads in register-hungry tiles).
#define AVX512_FN __attribute__((target("avx2,fma,avx512f,avx512vl")))
#define FORKLINE_INLINE inline __attribute__((always_inline))
#endif

namespace forkline {

// Cache-line-aligned storage for activation rows: the kernels' 32-byte loads of a row block then never
// straddle two lines (inputs arrived 8-56 bytes past a line; a 3-4 row q8_0 tile on such an x ran at
// 0.65-0.8x in one window, within the noise in another).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) {
    ::operator delete(p, std::align_val_t{64});
  }
  template <class U>
  bool operator==(const LineAllocator<U>&) const {
    return true;
  }
};
template <class T>
using LineVector = std::vector<T, LineAllocator<T>>;

// x itself when 32-byte aligned, else a copy of its `count` floats in `buf`.
inline const float* line_aligned(const float* x, size_t count, LineVector<float>& buf) {
  if (reinterpret_cast<uintptr_t>(x) % 32 == 0) {
    return x;
  }
  buf.assign(x, x + count);
  return buf.data();
}

// "[d0, d1, ...]" of an array's shape.
inline std::string shape_str(const mlx::core::array& a) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < a.ndim(); ++i) {
    os << (i ? ", " : "") << a.shape(i);
  }
  os << "]";
  return os.str();
}

// The fixed lane reduction every kernel's scalar version uses: (a0+a4 + a2+a6) + (a1+a5 + a3+a7).
inline float reduce8(const float* a) {
  const float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

#if FORKLINE_X86
// The 8 lanes summed in one fixed order: (t0 + t2) + (t1 + t3) of the halves' sums t = lo + hi. The
// scalar fallbacks reproduce exactly this order, so both ISAs agree bit for bit.
AVX2_FN FORKLINE_INLINE float reduce8_avx2(__m256 acc) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // t0..t3
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // t0+t2, t1+t3
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}
#endif

}  // namespace forkline
