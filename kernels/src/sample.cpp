#include "sample.h"

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"

#include "common.h"
#include "qdot.h"
#include "vmath.h"

namespace forkline {

namespace {

constexpr int kBlock = 64;  // entries per block sum: 8 lanes x 8 steps

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("categorical: " + what);
}

inline float weight_scalar(float x, float m, float inv_t) {
  return x == m ? 1.0f : vmath::exp_scalar((x - m) * inv_t);
}

float row_max_scalar(const float* x, int V) {
  float m = x[0];
  for (int i = 1; i < V; ++i) {
    m = x[i] > m ? x[i] : m;
  }
  return m;
}

// The block's sum in the lanes' order: lane l adds entries l, l + 8, ... (absent ones as 0), then reduce8's.
float block_sum_scalar(const float* x, int begin, int V, float m, float inv_t) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int k = 0; k < kBlock / 8; ++k) {
    for (int l = 0; l < 8; ++l) {
      const int i = begin + 8 * k + l;
      lane[l] = lane[l] + (i < V ? weight_scalar(x[i], m, inv_t) : 0.0f);
    }
  }
  return reduce8(lane);
}

#if FORKLINE_X86
AVX2_FN float row_max_avx2(const float* x, int V) {
  if (V < 8) {
    return row_max_scalar(x, V);
  }
  __m256 acc = _mm256_loadu_ps(x);
  int i = 8;
  for (; i + 8 <= V; i += 8) {
    acc = _mm256_max_ps(acc, _mm256_loadu_ps(x + i));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float m = lanes[0];
  for (int l = 1; l < 8; ++l) {
    m = lanes[l] > m ? lanes[l] : m;
  }
  for (; i < V; ++i) {
    m = x[i] > m ? x[i] : m;
  }
  return m;
}

AVX2_FN float block_sum_avx2(const float* x, int begin, int V, float m, float inv_t) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), one = _mm256_set1_ps(1.0f);
  const __m256i lane_ids = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 acc = _mm256_setzero_ps();
  for (int k = 0; k < kBlock / 8; ++k) {
    const int i = begin + 8 * k;
    __m256 xv;
    __m256 present;
    if (i + 8 <= V) {
      xv = _mm256_loadu_ps(x + i);
      present = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    } else {
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(V - i), lane_ids);  // lanes < V - i
      xv = _mm256_maskload_ps(x + i, mask);  // lanes at or past V are never read
      present = _mm256_castsi256_ps(mask);
    }
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(xv, vm), vt);
    __m256 p = _mm256_blendv_ps(vmath::exp_avx2(z), one, _mm256_cmp_ps(xv, vm, _CMP_EQ_OQ));
    p = _mm256_and_ps(p, present);
    acc = _mm256_add_ps(acc, p);
  }
  return reduce8_avx2(acc);
}
#endif

int first_of(const float* x, int V, float m) {
  for (int i = 0; i < V; ++i) {
    if (x[i] == m) {
      return i;
    }
  }
  return 0;
}

using RowMax = float (*)(const float*, int);
using BlockSum = float (*)(const float*, int, int, float, float);

}  // namespace

int categorical_row(const float* x, int V, float inv_t, float u) {
  RowMax row_max = row_max_scalar;
  BlockSum block_sum = block_sum_scalar;
#if FORKLINE_X86
  if (active_isa() != Isa::scalar) {
    row_max = row_max_avx2;
    block_sum = block_sum_avx2;
  }
#endif
  const float m = row_max(x, V);
  if (!(m > -std::numeric_limits<float>::infinity())) {  // every entry -inf (or NaN): the first maximum
    return first_of(x, V, m);
  }
  const int blocks = (V + kBlock - 1) / kBlock;
  thread_local std::vector<float> sums;
  sums.resize(blocks);
  double total = 0.0;
  for (int b = 0; b < blocks; ++b) {
    sums[b] = block_sum(x, b * kBlock, V, m, inv_t);
    total += sums[b];
  }
  const double target = static_cast<double>(u) * total;
  double cum = 0.0;
  int b = 0;
  for (; b < blocks - 1 && cum + sums[b] <= target; ++b) {
    cum += sums[b];
  }
  // walk the crossing block entry by entry; rounding may leave it uncrossed: its last entry with weight
  int last = -1;
  const int end = (b + 1) * kBlock < V ? (b + 1) * kBlock : V;
  for (int i = b * kBlock; i < end; ++i) {
    const float p = weight_scalar(x[i], m, inv_t);
    if (p > 0.0f) {
      cum += p;
      last = i;
      if (cum > target) {
        return i;
      }
    }
  }
  return last >= 0 ? last : first_of(x, V, m);  // a block of zero weight: rounding passed every weight
}

mx::array categorical(const mx::array& logits, const mx::array& uniforms, float inv_temperature,
                      mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    bad("CPU streams only");
  }
  if (logits.ndim() != 2 || logits.shape(1) < 1 || logits.dtype() != mx::float32) {
    bad("logits must be float32 [rows, vocab >= 1], got " + shape_str(logits));
  }
  if (uniforms.ndim() != 1 || uniforms.shape(0) != logits.shape(0) || uniforms.dtype() != mx::float32) {
    bad("uniforms must be float32 [" + std::to_string(logits.shape(0)) + "], got " + shape_str(uniforms));
  }
  if (!(inv_temperature > 0.0f)) {
    bad("inv_temperature must be > 0, got " + std::to_string(inv_temperature));
  }
  return mx::array({logits.shape(0)}, mx::int32, std::make_shared<Categorical>(stream, inv_temperature),
                   {logits, uniforms});
}

void Categorical::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.dispatch([inputs, out, inv_t = inv_t_]() mutable {
    const mx::array& x = inputs[0];
    const mx::array& u = inputs[1];
    const int rows = x.shape(0), V = x.shape(1);
    const int64_t rs = x.strides()[0], cs = x.strides()[1];
    std::vector<float> row(cs == 1 ? 0 : V);
    for (int r = 0; r < rows; ++r) {
      const float* src = x.data<float>() + r * rs;
      if (cs != 1) {
        for (int i = 0; i < V; ++i) {
          row[i] = src[i * cs];
        }
        src = row.data();
      }
      const float ur = u.data<float>()[r * u.strides()[0]];
      out.data<int32_t>()[r] = categorical_row(src, V, inv_t, ur);
    }
  });
}

void Categorical::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("ForklineCategorical has no GPU implementation");
}

std::vector<mx::Shape> Categorical::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0)}};
}

bool Categorical::is_equivalent(const mx::Primitive& other) const {
  return inv_t_ == static_cast<const Categorical&>(other).inv_t_;
}

}  // namespace forkline
