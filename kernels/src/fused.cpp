#include "fused.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"

#include "common.h"
#include "gemm.h"
#include "pool.h"
#include "qdot.h"
#include "vmath.h"

namespace forkline {

namespace {

using vmath::exp_scalar;

// 2 * sqrt(2 / pi): gelu_tanh(g) = g / (1 + e**(-2c (g + 0.044715 g**3)))
constexpr float kGelu2C = 1.5957691216057308f;
constexpr float kGeluCube = 0.044715f;
// Epilogue elements below which the caller does them alone (a pool round trip costs more).
constexpr int64_t kParallelEpilogue = 1 << 15;

[[noreturn]] void bad(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string(op) + ": " + what);
}

// ---------------------------------------------------------------- row-local pieces (scalar, AVX2)

// sum of x[i]**2: lane j over i = 8b + j (fma, blocks in order), the fixed lane sum, then the tail.
float sum_squares_scalar(const float* x, int n) {
  const int n8 = n / 8 * 8;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int b = 0; b < n8; b += 8) {
    for (int j = 0; j < 8; ++j) {
      acc[j] = std::fma(x[b + j], x[b + j], acc[j]);
    }
  }
  float s = reduce8(acc);
  for (int i = n8; i < n; ++i) {
    s = std::fma(x[i], x[i], s);
  }
  return s;
}

void scale_mul_scalar(const float* x, float r, const float* w, float* out, int n) {
  for (int i = 0; i < n; ++i) {
    out[i] = (x[i] * r) * w[i];
  }
}

inline float silu_mul(float g, float u) {
  return (g * u) / (1.0f + exp_scalar(-g));
}

inline float gelu_mul(float g, float u) {
  const float inner = g + ((kGeluCube * g) * g) * g;
  return (g * u) / (1.0f + exp_scalar(-kGelu2C * inner));
}

void act_scalar(Act act, const float* g, const float* u, float* out, int n) {
  for (int i = 0; i < n; ++i) {
    out[i] = act == Act::silu ? silu_mul(g[i], u[i]) : gelu_mul(g[i], u[i]);
  }
}

#if FORKLINE_X86
AVX2_FN float sum_squares_avx2(const float* x, int n) {
  const int n8 = n / 8 * 8;
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < n8; b += 8) {
    const __m256 v = _mm256_loadu_ps(x + b);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = reduce8_avx2(acc);
  for (int i = n8; i < n; ++i) {
    s = std::fma(x[i], x[i], s);
  }
  return s;
}

AVX2_FN void scale_mul_avx2(const float* x, float r, const float* w, float* out, int n) {
  const __m256 rv = _mm256_set1_ps(r);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  }
  for (; i < n; ++i) {
    out[i] = (x[i] * r) * w[i];
  }
}

AVX2_FN void act_avx2(Act act, const float* g, const float* u, float* out, int n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const __m256 cube = _mm256_set1_ps(kGeluCube), c2 = _mm256_set1_ps(-kGelu2C);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
    __m256 z;
    if (act == Act::silu) {
      z = _mm256_xor_ps(gv, sign);  // -g
    } else {
      const __m256 inner = _mm256_add_ps(gv, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(cube, gv), gv), gv));
      z = _mm256_mul_ps(c2, inner);
    }
    const __m256 e = vmath::exp_avx2(z);
    _mm256_storeu_ps(out + i, _mm256_div_ps(_mm256_mul_ps(gv, uv), _mm256_add_ps(one, e)));
  }
  act_scalar(act, g + i, u + i, out + i, n - i);
}
#endif

float sum_squares(Isa isa, const float* x, int n) {
#if FORKLINE_X86
  if (isa != Isa::scalar) {
    return sum_squares_avx2(x, n);
  }
#endif
  return sum_squares_scalar(x, n);
}

// out = (x * rms) * w with rms = 1 / sqrt(sum(x**2) / n + eps); out may be x.
void rms_norm_row(Isa isa, const float* x, const float* w, float eps, float* out, int n) {
  const float r = 1.0f / std::sqrt(sum_squares(isa, x, n) / static_cast<float>(n) + eps);
#if FORKLINE_X86
  if (isa != Isa::scalar) {
    scale_mul_avx2(x, r, w, out, n);
    return;
  }
#endif
  scale_mul_scalar(x, r, w, out, n);
}

void act_row(Isa isa, Act act, const float* g, const float* u, float* out, int n) {
#if FORKLINE_X86
  if (isa != Isa::scalar) {
    act_avx2(act, g, u, out, n);
    return;
  }
#endif
  act_scalar(act, g, u, out, n);
}

// out = x * cos + swap(x) * sin over one head of d elements.
void rope_head(const float* x, const float* c, const float* s, bool traditional, float* out, int d) {
  const int half = d / 2;
  for (int i = 0; i < d; ++i) {
    const int j = traditional ? (i ^ 1) : (i < half ? i + half : i - half);
    out[i] = x[i] * c[i] + x[j] * s[i];
  }
}

void store_kv(const float* src, int n, int kv_type, void* dst) {
  if (kv_type == 0) {
    std::copy(src, src + n, static_cast<float*>(dst));
  } else if (kv_type == 1) {
    uint16_t* o = static_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) {
      o[i] = vmath::float_to_half(src[i]);
    }
  } else {
    uint16_t* o = static_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) {
      o[i] = vmath::float_to_bfloat(src[i]);
    }
  }
}

// ---------------------------------------------------------------- reading inputs

// Per-row base offsets (elements) of a [..., C] array viewed as [rows, C]; col_stride: the last one.
std::vector<int64_t> row_offsets(const mx::array& a, int64_t rows) {
  std::vector<int64_t> off(rows);
  const int nd = a.ndim();
  const auto& shape = a.shape();
  const auto& st = a.strides();
  for (int64_t r = 0; r < rows; ++r) {
    int64_t rem = r, o = 0;
    for (int d = nd - 2; d >= 0; --d) {
      o += (rem % shape[d]) * st[d];
      rem /= shape[d];
    }
    off[r] = o;
  }
  return off;
}

// A float32 array's elements in row-major order: its own buffer when row-contiguous, else a copy.
const float* dense(const mx::array& a, std::vector<float>& buf) {
  if (a.flags().row_contiguous) {
    return a.data<float>();
  }
  const int64_t c = a.ndim() ? a.shape(-1) : 1;
  const int64_t rows = c ? static_cast<int64_t>(a.size()) / c : 0;
  const std::vector<int64_t> off = row_offsets(a, rows);
  const int64_t cs = a.ndim() ? a.strides().back() : 1;
  buf.resize(a.size());
  const float* p = a.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < c; ++i) {
      buf[r * c + i] = p[off[r] + i * cs];
    }
  }
  return buf.data();
}

// Runs fn(r0, r1) over row blocks: on the caller alone when the work is small.
template <class F>
void rows_parallel(int64_t rows, int64_t per_row, F&& fn) {
  WorkerPool& workers = pool();
  if (rows * per_row < kParallelEpilogue || workers.size() == 1 || rows == 1) {
    fn(0, rows);
    return;
  }
  const int64_t tasks = std::min<int64_t>(rows, workers.size() * 4);
  const int64_t block = (rows + tasks - 1) / tasks;
  workers.run(static_cast<int>((rows + block - 1) / block),
              [&](int t) { fn(t * block, std::min(rows, (t + 1) * block)); });
}

}  // namespace

void fused_run(const FusedSpec& spec, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const Isa isa = active_isa();
  const mx::array& x = inputs[0];
  const int K = spec.k;
  const int64_t M = K ? static_cast<int64_t>(x.size()) / K : 0;
  const int blocks = inputs[2].shape(1);
  const int Kp = blocks * 32;
  const int N = inputs[1].shape(0);
  if (M == 0) {
    return;
  }
  size_t at = 3;
  const float* mins = spec.format == Format::q4_1 ? inputs[at++].data<float>() : nullptr;
  thread_local std::vector<float> ybuf, nbuf, bbuf, pbuf, rbuf, qnbuf, knbuf, cbuf, sbuf;
  thread_local LineVector<float> xbuf;
  const float* normw = spec.norm ? dense(inputs[at++], nbuf) : nullptr;
  const float* bias = spec.bias ? dense(inputs[at++], bbuf) : nullptr;
  const float* postw = spec.post_norm ? dense(inputs[at++], pbuf) : nullptr;
  const float* res = spec.residual ? dense(inputs[at++], rbuf) : nullptr;
  const float* qn = nullptr;
  const float* kn = nullptr;
  if (spec.qk_norm) {
    qn = dense(inputs[at++], qnbuf);
    kn = dense(inputs[at++], knbuf);
  }
  const float* cosv = nullptr;
  const float* sinv = nullptr;
  if (spec.rope) {
    cosv = dense(inputs[at++], cbuf);
    sinv = dense(inputs[at++], sbuf);
  }
  // the activation rows: dense, zero-padded to Kp, normed
  const float* xr;
  if (!spec.norm && x.flags().row_contiguous && K == Kp) {
    xr = x.data<float>();
  } else {
    xbuf.resize(static_cast<size_t>(M) * Kp);
    const std::vector<int64_t> off = row_offsets(x, M);
    const int64_t cs = x.strides().back();
    const float* xp = x.data<float>();
    float* xb = xbuf.data();
    rows_parallel(M, K, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* dst = xb + r * Kp;
        for (int i = 0; i < K; ++i) {
          dst[i] = xp[off[r] + i * cs];
        }
        std::fill(dst + K, dst + Kp, 0.0f);
        if (normw != nullptr) {
          rms_norm_row(isa, dst, normw, spec.eps, dst, K);
        }
      }
    });
    xr = xb;
  }
  const bool heads = spec.q_heads > 0;
  const int W = spec.act != Act::none ? N / 2 : N;  // output width (linear mode)
  // the matmul straight into the output when the epilogue (if any) can run in place there
  const bool direct = !heads && spec.act == Act::none;
  float* y;
  if (direct) {
    y = outputs[0].data<float>();
  } else {
    ybuf.resize(static_cast<size_t>(M) * N);
    y = ybuf.data();
  }
  if (spec.panel) {
    panel_matmul(active_isa(), spec.format, xr, static_cast<int>(M), blocks, N, inputs[1].data<void>(),
                 inputs[2].data<float>(), mins, y, N);
  } else {
    float_rows_matmul(spec.format, xr, static_cast<int>(M), blocks, N, inputs[1].data<void>(),
                      inputs[2].data<float>(), mins, y, N);
  }
  if (heads) {
    const int D = spec.head_dim, hq = spec.q_heads, hkv = spec.kv_heads;
    float* qo = outputs[0].data<float>();
    char* ko = outputs[1].data<char>();
    char* vo = outputs[2].data<char>();
    const int64_t esz = spec.kv_type == 0 ? 4 : 2;
    rows_parallel(M, N, [&](int64_t r0, int64_t r1) {
      std::vector<float> tmp(D), rot(D);
      for (int64_t r = r0; r < r1; ++r) {
        float* yr = y + r * N;
        if (bias != nullptr) {
          for (int j = 0; j < N; ++j) {
            yr[j] = yr[j] + bias[j];
          }
        }
        const float* c = spec.rope ? cosv + r * D : nullptr;
        const float* s = spec.rope ? sinv + r * D : nullptr;
        for (int h = 0; h < hq + hkv; ++h) {
          const float* src = yr + static_cast<int64_t>(h) * D;
          const float* nw = h < hq ? qn : kn;
          if (nw != nullptr) {
            rms_norm_row(isa, src, nw, spec.qk_eps, tmp.data(), D);
            src = tmp.data();
          }
          float* dst = h < hq ? qo + (r * hq + h) * D : rot.data();
          if (spec.rope) {
            rope_head(src, c, s, spec.traditional, dst, D);
          } else {
            std::copy(src, src + D, dst);
          }
          if (h >= hq) {
            store_kv(dst, D, spec.kv_type, ko + ((r * hkv) + (h - hq)) * D * esz);
          }
        }
        for (int h = 0; h < hkv; ++h) {
          store_kv(yr + static_cast<int64_t>(hq + hkv + h) * D, D, spec.kv_type, vo + ((r * hkv) + h) * D * esz);
        }
      }
    });
    return;
  }
  if (!(spec.bias || spec.act != Act::none || spec.post_norm || spec.residual)) {
    return;
  }
  float* out = outputs[0].data<float>();
  rows_parallel(M, N, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* yr = y + r * N;
      float* o = out + r * W;
      if (bias != nullptr) {
        for (int j = 0; j < N; ++j) {
          yr[j] = yr[j] + bias[j];
        }
      }
      if (spec.act != Act::none) {
        act_row(isa, spec.act, yr, yr + W, o, W);
      }
      if (postw != nullptr) {
        rms_norm_row(isa, o, postw, spec.post_eps, o, W);
      }
      if (res != nullptr) {
        const float* rr = res + r * W;
        for (int j = 0; j < W; ++j) {
          o[j] = rr[j] + o[j];
        }
      }
    }
  });
}

namespace {

// ---------------------------------------------------------------- graph construction

struct Checked {
  Format format;
  int k, n, blocks;
  mx::Shape lead;
};

Checked check_weights(const char* op, const mx::array& x, const mx::array& wq, const mx::array& scales,
                      const std::optional<mx::array>& mins) {
  if (wq.ndim() != 2) {
    bad(op, "weights must be 2-D, got " + shape_str(wq));
  }
  Format format;
  if (wq.dtype() == mx::int8) {
    format = Format::q8_0;
    if (mins) {
      bad(op, "int8 (q8_0) weights take no mins");
    }
  } else if (wq.dtype() == mx::uint8) {
    format = Format::q4_1;
    if (!mins) {
      bad(op, "uint8 (q4_1) weights need mins");
    }
  } else {
    bad(op, "weights must be int8 (q8_0) or uint8 (q4_1)");
  }
  const int n = wq.shape(0);
  const int packed = format == Format::q8_0 ? 32 : 16;
  if (wq.shape(1) % packed != 0) {
    bad(op, "weights must have a multiple of " + std::to_string(packed) + " columns, got " + shape_str(wq));
  }
  const int blocks = wq.shape(1) / packed;
  for (const mx::array* a : {&scales, mins ? &*mins : nullptr}) {
    if (a != nullptr && (a->dtype() != mx::float32 || a->ndim() != 2 || a->shape(0) != n || a->shape(1) != blocks)) {
      bad(op, "scales / mins must be float32 [" + std::to_string(n) + ", " + std::to_string(blocks) + "], got " +
                  shape_str(*a));
    }
  }
  if (x.ndim() < 1 || !mx::issubdtype(x.dtype(), mx::floating)) {
    bad(op, "x must be a floating-point array with at least one dimension");
  }
  const int k = x.shape(-1);
  if (k > blocks * 32 || k <= blocks * 32 - 32) {
    bad(op, "x has " + std::to_string(k) + " columns, the weights " + std::to_string(blocks * 32) +
                " (padded to a multiple of 32)");
  }
  return {format, k, n, blocks, mx::Shape(x.shape().begin(), x.shape().end() - 1)};
}

mx::array vec(const char* op, const char* what, const mx::array& a, int n, mx::Stream s) {
  if (a.ndim() != 1 || a.shape(0) != n || !mx::issubdtype(a.dtype(), mx::floating)) {
    bad(op, std::string(what) + " must be a float vector [" + std::to_string(n) + "], got " + shape_str(a));
  }
  return mx::astype(a, mx::float32, s);
}

mx::Stream cpu_stream(const char* op, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    bad(op, "CPU streams only");
  }
  return stream;
}

}  // namespace

mx::array fused_linear(const mx::array& x, const mx::array& wq, const mx::array& scales,
                       const std::optional<mx::array>& mins, const std::optional<mx::array>& norm, float eps,
                       const std::optional<mx::array>& bias, const std::string& act,
                       const std::optional<mx::array>& post_norm, float post_eps,
                       const std::optional<mx::array>& residual, bool panel, mx::StreamOrDevice s) {
  const char* op = "fused_linear";
  mx::Stream stream = cpu_stream(op, s);
  const Checked c = check_weights(op, x, wq, scales, mins);
  FusedSpec spec;
  spec.format = c.format;
  spec.k = c.k;
  spec.panel = panel;
  if (act == "silu") {
    spec.act = Act::silu;
  } else if (act == "gelu_tanh") {
    spec.act = Act::gelu_tanh;
  } else if (!act.empty()) {
    bad(op, "act must be '', 'silu' or 'gelu_tanh', got '" + act + "'");
  }
  if (spec.act != Act::none && c.n % 2 != 0) {
    bad(op, "a gated activation needs an even number of outputs (gate rows, then up rows)");
  }
  const int w = spec.act != Act::none ? c.n / 2 : c.n;
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, stream), wq, scales};
  if (mins) {
    inputs.push_back(*mins);
  }
  if (norm) {
    spec.norm = true;
    spec.eps = eps;
    inputs.push_back(vec(op, "norm", *norm, c.k, stream));
  }
  if (bias) {
    spec.bias = true;
    inputs.push_back(vec(op, "bias", *bias, c.n, stream));
  }
  if (post_norm) {
    spec.post_norm = true;
    spec.post_eps = post_eps;
    inputs.push_back(vec(op, "post_norm", *post_norm, w, stream));
  }
  mx::Shape shape = c.lead;
  shape.push_back(w);
  if (residual) {
    if (residual->shape() != shape || !mx::issubdtype(residual->dtype(), mx::floating)) {
      std::string want = "[";
      for (size_t i = 0; i < shape.size(); ++i) {
        want += (i ? ", " : "") + std::to_string(shape[i]);
      }
      bad(op, "residual must be a float array " + want + "], got " + shape_str(*residual));
    }
    spec.residual = true;
    inputs.push_back(mx::astype(*residual, mx::float32, stream));
  }
  return mx::array(shape, mx::float32, std::make_shared<FusedLinear>(stream, spec), std::move(inputs));
}

std::tuple<mx::array, mx::array, mx::array> fused_qkv(
    const mx::array& x, const mx::array& wq, const mx::array& scales, const std::optional<mx::array>& mins,
    int q_heads, int kv_heads, int head_dim, const std::optional<mx::array>& norm, float eps,
    const std::optional<mx::array>& bias, const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm, float qk_eps, const std::optional<mx::array>& cos,
    const std::optional<mx::array>& sin, bool traditional, mx::Dtype kv_dtype, bool panel,
    mx::StreamOrDevice s) {
  const char* op = "fused_qkv";
  mx::Stream stream = cpu_stream(op, s);
  const Checked c = check_weights(op, x, wq, scales, mins);
  if (q_heads < 1 || kv_heads < 1 || head_dim < 1 || c.n != (q_heads + 2 * kv_heads) * head_dim) {
    bad(op, "the weights' " + std::to_string(c.n) + " rows must be (q_heads + 2 * kv_heads) * head_dim");
  }
  if (head_dim % 2 != 0) {
    bad(op, "head_dim must be even");
  }
  FusedSpec spec;
  spec.format = c.format;
  spec.k = c.k;
  spec.q_heads = q_heads;
  spec.kv_heads = kv_heads;
  spec.head_dim = head_dim;
  spec.traditional = traditional;
  spec.panel = panel;
  if (kv_dtype == mx::float32) {
    spec.kv_type = 0;
  } else if (kv_dtype == mx::float16) {
    spec.kv_type = 1;
  } else if (kv_dtype == mx::bfloat16) {
    spec.kv_type = 2;
  } else {
    bad(op, "kv_dtype must be float32, float16 or bfloat16");
  }
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, stream), wq, scales};
  if (mins) {
    inputs.push_back(*mins);
  }
  if (norm) {
    spec.norm = true;
    spec.eps = eps;
    inputs.push_back(vec(op, "norm", *norm, c.k, stream));
  }
  if (bias) {
    spec.bias = true;
    inputs.push_back(vec(op, "bias", *bias, c.n, stream));
  }
  if (q_norm.has_value() != k_norm.has_value()) {
    bad(op, "q_norm and k_norm go together");
  }
  if (q_norm) {
    spec.qk_norm = true;
    spec.qk_eps = qk_eps;
    inputs.push_back(vec(op, "q_norm", *q_norm, head_dim, stream));
    inputs.push_back(vec(op, "k_norm", *k_norm, head_dim, stream));
  }
  int64_t rows = 1;
  for (int d : c.lead) {
    rows *= d;
  }
  if (cos.has_value() != sin.has_value()) {
    bad(op, "cos and sin go together");
  }
  if (cos) {
    for (const mx::array* t : {&*cos, &*sin}) {
      if (static_cast<int64_t>(t->size()) != rows * head_dim || t->ndim() < 1 || t->shape(-1) != head_dim) {
        bad(op, "cos / sin must hold [rows, head_dim] = [" + std::to_string(rows) + ", " +
                    std::to_string(head_dim) + "] values, got " + shape_str(*t));
      }
    }
    spec.rope = true;
    inputs.push_back(mx::astype(*cos, mx::float32, stream));
    inputs.push_back(mx::astype(*sin, mx::float32, stream));
  }
  mx::Shape qs = c.lead, ks = c.lead;
  qs.insert(qs.end(), {q_heads, head_dim});
  ks.insert(ks.end(), {kv_heads, head_dim});
  auto outs = mx::array::make_arrays({qs, ks, ks}, {mx::float32, kv_dtype, kv_dtype},
                                     std::make_shared<FusedLinear>(stream, spec), std::move(inputs));
  return {outs[0], outs[1], outs[2]};
}

void FusedLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  for (size_t i = 1; i < 3 + (spec_.format == Format::q4_1 ? 1 : 0); ++i) {
    if (!inputs[i].flags().row_contiguous) {
      bad(name(), "quantized weights must be row-contiguous");
    }
  }
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // The task holds its own references to the arrays until it has run.
  encoder.dispatch([inputs, outputs, spec = spec_]() mutable { fused_run(spec, inputs, outputs); });
}

void FusedLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(name()) + " has no GPU implementation");
}

std::vector<mx::Shape> FusedLinear::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::array& x = inputs[0];
  mx::Shape lead(x.shape().begin(), x.shape().end() - 1);
  if (spec_.q_heads > 0) {
    mx::Shape qs = lead, ks = lead;
    qs.insert(qs.end(), {spec_.q_heads, spec_.head_dim});
    ks.insert(ks.end(), {spec_.kv_heads, spec_.head_dim});
    return {qs, ks, ks};
  }
  const int n = inputs[1].shape(0);
  lead.push_back(spec_.act != Act::none ? n / 2 : n);
  return {lead};
}

bool FusedLinear::is_equivalent(const mx::Primitive& other) const {
  return spec_ == static_cast<const FusedLinear&>(other).spec_;
}

}  // namespace forkline
