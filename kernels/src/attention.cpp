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

namespace forkline {

namespace {

// Below this many multiply-adds (rows x keys x head_dim) one thread runs the call (a pool round trip
// costs more).
constexpr int64_t kParallelWork = 1 << 16;
// Most q heads per kv head scored together (they share each key and value load).
constexpr int kMaxGroup = 8;

// e**x as 2**n * e**r (n = round(x / ln 2), Cody-Waite reduction, degree-7 Taylor polynomial): only
// multiplies, adds and bit operations, so the scalar and AVX2 versions agree bit for bit. x < -87
// gives exactly 0 (masked or negligible weights; also e**-inf), x is clamped at 88.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2**23: (v + kRound) - kRound rounds v to an integer
constexpr float kLn2Hi = 0.693359375f;  // n * kLn2Hi is exact for |n| <= 127
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLo = -87.0f, kExpHi = 88.0f;
constexpr float kC[8] = {1.0f, 1.0f, 0.5f, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720, 1.0f / 5040};

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("causal_attention: " + what);
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

// The fixed lane reduction both versions use: (a0+a4 + a2+a6) + (a1+a5 + a3+a7).
inline float reduce8(const float* a) {
  float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

// ---------------------------------------------------------------- kernels
//
// scores: s[r * ld + t] = scale * (q_r . k_t) for r < R, t < L. The dot product: lane j sums elements
//   d = 8b + j over blocks b in order (fma), reduce8, then the D % 8 tail elements in order (fma).
// exp_sum: e[t] = exp(s[t] - mx) for t < L, 0 for L <= t < ld; returns the sum: lane j adds e[8b + j]
//   over blocks b in order, then reduce8.
// pv: o_r = o_r * alpha_r, then o_r = fma(e_r[t], v_t, o_r) for t in order (element-wise).

struct Scalar {
  static void scores(const float* const* q, int R, const float* const* k, int L, int D, float scale,
                     float* s, int ld) {
    const int D8 = D / 8 * 8;
    for (int t = 0; t < L; ++t) {
      for (int r = 0; r < R; ++r) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int b = 0; b < D8; b += 8) {
          for (int j = 0; j < 8; ++j) {
            acc[j] = std::fma(q[r][b + j], k[t][b + j], acc[j]);
          }
        }
        float sum = reduce8(acc);
        for (int i = D8; i < D; ++i) {
          sum = std::fma(q[r][i], k[t][i], sum);
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

  static void pv(float* o, int R, int D, const float* alpha, const float* e, int ld, const float* const* v,
                 int L) {
    for (int r = 0; r < R; ++r) {
      float* orow = o + static_cast<int64_t>(r) * D;
      for (int i = 0; i < D; ++i) {
        orow[i] = orow[i] * alpha[r];
      }
    }
    for (int t = 0; t < L; ++t) {
      for (int r = 0; r < R; ++r) {
        float* orow = o + static_cast<int64_t>(r) * D;
        const float w = e[r * ld + t];
        for (int i = 0; i < D; ++i) {
          orow[i] = std::fma(w, v[t][i], orow[i]);
        }
      }
    }
  }
};

#if FORKLINE_X86

AVX2_FN inline __m256 exp_avx2(__m256 x) {
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

struct Avx2 {
  AVX2_FN static void scores(const float* const* q, int R, const float* const* k, int L, int D, float scale,
                             float* s, int ld) {
    const int D8 = D / 8 * 8;
    for (int t = 0; t < L; ++t) {
      const float* kt = k[t];
      __m256 acc[kMaxGroup];
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_setzero_ps();
      }
      for (int b = 0; b < D8; b += 8) {
        const __m256 kv = _mm256_loadu_ps(kt + b);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + b), kv, acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        float sum = reduce8_avx2(acc[r]);
        for (int i = D8; i < D; ++i) {
          sum = std::fma(q[r][i], kt[i], sum);
        }
        s[r * ld + t] = sum * scale;
      }
    }
  }

  AVX2_FN static float exp_sum(const float* s, int L, float mx_, float* e, int ld) {
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

  AVX2_FN static void pv(float* o, int R, int D, const float* alpha, const float* e, int ld,
                         const float* const* v, int L) {
    const int D8 = D / 8 * 8;
    for (int r = 0; r < R; ++r) {
      float* orow = o + static_cast<int64_t>(r) * D;
      const __m256 a = _mm256_set1_ps(alpha[r]);
      int i = 0;
      for (; i < D8; i += 8) {
        _mm256_storeu_ps(orow + i, _mm256_mul_ps(_mm256_loadu_ps(orow + i), a));
      }
      for (; i < D; ++i) {
        orow[i] = orow[i] * alpha[r];
      }
    }
    // blocks of 8 output elements held in registers across all keys; each value load serves R rows
    for (int i = 0; i < D8; i += 8) {
      __m256 acc[kMaxGroup];
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_loadu_ps(o + static_cast<int64_t>(r) * D + i);
      }
      for (int t = 0; t < L; ++t) {
        const __m256 vv = _mm256_loadu_ps(v[t] + i);
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(e[r * ld + t]), vv, acc[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(o + static_cast<int64_t>(r) * D + i, acc[r]);
      }
    }
    for (int i = D8; i < D; ++i) {
      for (int t = 0; t < L; ++t) {
        for (int r = 0; r < R; ++r) {
          float& x = o[static_cast<int64_t>(r) * D + i];
          x = std::fma(e[r * ld + t], v[t][i], x);
        }
      }
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
  std::vector<const float*> k0, v0;  // per sorted key: its row at kv head 0
  std::vector<int64_t> khs, vhs;  // per sorted key: its part's kv-head stride
  float* out = nullptr;  // [n, hq, d]
};

struct Scratch {
  std::vector<const float*> kp, vp;
  std::vector<float> s, e, o;
};

// Query row i, kv head g: the q heads g * rep .. g * rep + rep - 1 (in groups of kMaxGroup).
template <class K>
void attend(const Plan& P, int i, int g, Scratch& w) {
  const int p = P.qpos[i];
  const int lo = P.window > 0 ? std::max(0, p - P.window + 1) : 0;
  const int32_t* pos = P.pos.data();
  const int total = static_cast<int>(P.pos.size());
  const int j0 = p < 0 ? 0 : static_cast<int>(std::lower_bound(pos, pos + total, lo) - pos);
  const int j1 = p < 0 ? 0 : static_cast<int>(std::upper_bound(pos, pos + total, p) - pos);
  const int D = P.d;
  for (int h0 = 0; h0 < P.rep; h0 += kMaxGroup) {
    const int R = std::min(kMaxGroup, P.rep - h0);
    const float* q[kMaxGroup];
    float m[kMaxGroup], l[kMaxGroup], alpha[kMaxGroup];
    for (int r = 0; r < R; ++r) {
      q[r] = P.q + i * P.qs0 + static_cast<int64_t>(g * P.rep + h0 + r) * P.qs1;
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.0f;
    }
    w.o.assign(static_cast<size_t>(R) * D, 0.0f);
    for (int j = j0; j < j1;) {
      // the chunk of absolute positions [c * chunk, (c + 1) * chunk) holding key j
      const int64_t boundary = (static_cast<int64_t>(pos[j]) / P.chunk + 1) * P.chunk;
      const int je = boundary > std::numeric_limits<int32_t>::max()
                         ? j1
                         : static_cast<int>(std::lower_bound(pos + j, pos + j1, static_cast<int32_t>(boundary)) - pos);
      const int L = je - j;
      const int ld = (L + 7) / 8 * 8;
      w.kp.resize(L);
      w.vp.resize(L);
      for (int t = 0; t < L; ++t) {
        w.kp[t] = P.k0[j + t] + g * P.khs[j + t];
        w.vp[t] = P.v0[j + t] + g * P.vhs[j + t];
      }
      w.s.resize(static_cast<size_t>(R) * ld);
      w.e.resize(static_cast<size_t>(R) * ld);
      K::scores(q, R, w.kp.data(), L, D, P.scale, w.s.data(), ld);
      for (int r = 0; r < R; ++r) {
        const float* s = w.s.data() + r * ld;
        float cm = s[0];
        for (int t = 1; t < L; ++t) {
          cm = s[t] > cm ? s[t] : cm;
        }
        const float mn = cm > m[r] ? cm : m[r];
        alpha[r] = exp_scalar(m[r] - mn);  // 0 for the first chunk (m = -inf)
        const float lc = K::exp_sum(s, L, mn, w.e.data() + r * ld, ld);
        l[r] = l[r] * alpha[r] + lc;
        m[r] = mn;
      }
      K::pv(w.o.data(), R, D, alpha, w.e.data(), ld, w.vp.data(), L);
      j = je;
    }
    for (int r = 0; r < R; ++r) {
      float* dst = P.out + (static_cast<int64_t>(i) * P.hq + g * P.rep + h0 + r) * D;
      const float* src = w.o.data() + static_cast<int64_t>(r) * D;
      for (int x = 0; x < D; ++x) {
        dst[x] = src[x] / l[r];  // no key: 0 / 0 = NaN
      }
    }
  }
}

void attend_items(Isa isa, const Plan& P, int a, int b, Scratch& w) {
  for (int item = a; item < b; ++item) {
    const int i = item / P.hkv, g = item % P.hkv;
#if FORKLINE_X86
    if (isa != Isa::scalar) {
      attend<Avx2>(P, i, g, w);
      continue;
    }
#endif
    attend<Scalar>(P, i, g, w);
  }
}

// A float array with a unit last stride: the array itself or a dense copy held in `copy`.
const float* dense3(const mx::array& a, std::vector<float>& copy, int64_t& s0, int64_t& s1) {
  const auto& st = a.strides();
  if (st[2] == 1) {
    s0 = st[0];
    s1 = st[1];
    return a.data<float>();
  }
  const int64_t A = a.shape(0), B = a.shape(1), C = a.shape(2);
  copy.resize(static_cast<size_t>(A * B * C));
  const float* src = a.data<float>();
  for (int64_t x = 0; x < A; ++x) {
    for (int64_t y = 0; y < B; ++y) {
      for (int64_t z = 0; z < C; ++z) {
        copy[(x * B + y) * C + z] = src[x * st[0] + y * st[1] + z * st[2]];
      }
    }
  }
  s0 = B * C;
  s1 = C;
  return copy.data();
}

}  // namespace

mx::array causal_attention(const mx::array& q, const mx::array& q_pos, const std::vector<mx::array>& keys,
                           const std::vector<mx::array>& values, const std::vector<mx::array>& key_pos,
                           float scale, int window, int chunk, mx::StreamOrDevice s) {
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
  if (!mx::issubdtype(q.dtype(), mx::floating)) {
    bad("q must be a floating-point array");
  }
  const int hkv = keys[0].ndim() == 3 ? keys[0].shape(0) : 0;
  if (hkv < 1 || hq % hkv != 0) {
    bad("q heads (" + std::to_string(hq) + ") must be a multiple of kv heads, keys " + shape_str(keys[0]));
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
    inputs.push_back(mx::astype(k, mx::float32, stream));
    inputs.push_back(mx::astype(v, mx::float32, stream));
  }
  return mx::array({n, hq, d}, mx::float32, std::make_shared<CausalAttention>(stream, scale, window, chunk),
                   std::move(inputs));
}

void CausalAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // The task holds its own references to the arrays until it has run.
  encoder.dispatch([inputs, out, scale = scale_, window = window_, chunk = chunk_]() mutable {
    const mx::array& q = inputs[0];
    Plan P;
    P.n = q.shape(0);
    P.hq = q.shape(1);
    P.d = q.shape(2);
    P.hkv = inputs[3].shape(0);
    P.rep = P.hq / P.hkv;
    P.window = window;
    P.chunk = chunk;
    P.scale = scale;
    P.out = out.data<float>();
    if (P.n == 0 || P.hq == 0 || P.d == 0) {
      return;
    }
    std::vector<float> qcopy;
    P.q = dense3(q, qcopy, P.qs0, P.qs1);
    const int32_t* qp = inputs[1].data<int32_t>();
    P.qpos.resize(P.n);
    for (int i = 0; i < P.n; ++i) {
      P.qpos[i] = qp[i * inputs[1].strides()[0]];
    }
    // every readable key (position >= 0) of every part, then sorted by position (stable: a caller's
    // duplicate positions at least keep one order)
    const size_t parts = (inputs.size() - 2) / 3;
    std::vector<std::vector<float>> copies(2 * parts);
    struct Key {
      int32_t pos;
      const float* k;
      const float* v;
      int64_t khs, vhs;
    };
    std::vector<Key> found;
    for (size_t part = 0; part < parts; ++part) {
      const mx::array& kp = inputs[2 + 3 * part];
      int64_t ks0, ks1, vs0, vs1;
      const float* kb = dense3(inputs[3 + 3 * part], copies[2 * part], ks0, ks1);
      const float* vb = dense3(inputs[4 + 3 * part], copies[2 * part + 1], vs0, vs1);
      const int32_t* kpp = kp.data<int32_t>();
      const int64_t kst = kp.strides()[0];
      for (int row = 0; row < kp.shape(0); ++row) {
        const int32_t p = kpp[row * kst];
        if (p >= 0) {
          found.push_back({p, kb + row * ks1, vb + row * vs1, ks0, vs0});
        }
      }
    }
    const bool sorted = std::is_sorted(found.begin(), found.end(), [](const Key& a, const Key& b) { return a.pos < b.pos; });
    if (!sorted) {
      std::stable_sort(found.begin(), found.end(), [](const Key& a, const Key& b) { return a.pos < b.pos; });
    }
    P.pos.resize(found.size());
    P.k0.resize(found.size());
    P.v0.resize(found.size());
    P.khs.resize(found.size());
    P.vhs.resize(found.size());
    for (size_t j = 0; j < found.size(); ++j) {
      P.pos[j] = found[j].pos;
      P.k0[j] = found[j].k;
      P.v0[j] = found[j].v;
      P.khs[j] = found[j].khs;
      P.vhs[j] = found[j].vhs;
    }
    const Isa isa = active_isa();
    const int items = P.n * P.hkv;
    WorkerPool& workers = pool();
    const int64_t work = static_cast<int64_t>(P.n) * P.hq * P.d * std::max<int64_t>(1, static_cast<int64_t>(found.size()));
    if (workers.size() == 1 || items == 1 || work < kParallelWork) {
      Scratch w;
      attend_items(isa, P, 0, items, w);
      return;
    }
    // items claimed in small blocks by the pool's threads: the split never changes a value
    const int block = std::max(1, items / (workers.size() * 8));
    workers.run((items + block - 1) / block, [&](int task) {
      thread_local Scratch w;  // the running thread's own
      attend_items(isa, P, task * block, std::min(items, (task + 1) * block), w);
    });
  });
}

void CausalAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("ForklineCausalAttention has no GPU implementation");
}

std::vector<mx::Shape> CausalAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

bool CausalAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CausalAttention&>(other);
  return scale_ == o.scale_ && window_ == o.window_ && chunk_ == o.chunk_;
}

}  // namespace forkline
