// Fused decoder-layer operations for MLX's CPU backend: a q8_0 / q4_1 matmul (the float kernels of
// qdot.h, or with panel the panel GEMM of gemm.h) with the elementwise work around it done in the same op, so a decode step issues a few
// ops per layer instead of ~40:
//
//   fused_linear: y = x' @ W.T with x' = rms_norm(x) * norm (optional), then y += bias, y = act(y[:, :N/2])
//     * y[:, N/2:] (act: silu or gelu_tanh; optional), y = rms_norm(y) * post_norm (optional),
//     y = residual + y (optional).
//   fused_qkv: y = x' @ W.T (+ bias) split into q / k / v heads; q and k heads RMS-normed per head
//     (optional: QK-norm), rotated by the RoPE tables (cos, sin [M, D]: out = x * cos + swap(x) * sin,
//     swap exchanging the halves or, traditional, the adjacent pairs); k and v written in the cache's
//     dtype (float32, float16 or bfloat16, rounded to nearest even).
//
// Every step is row-local and has one fixed order (the RMS sum of squares: 8 lanes over blocks of 8,
// the fixed pairwise lane sum, then the tail; rms = 1 / sqrt(sum / n + eps), out = (x * rms) * w;
// exp as vmath.h), with scalar and AVX2 versions bitwise equal: a row's result does not depend on the
// row count, the ISA, the thread count or the pool policy (deterministic mode relies on it).
#pragma once

#include <optional>
#include <tuple>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "qmatmul.h"

namespace mx = mlx::core;

namespace forkline {

enum class Act { none = 0, silu = 1, gelu_tanh = 2 };

struct FusedSpec {
  Format format = Format::q8_0;
  int k = 0;  // x's last dimension
  bool norm = false;
  float eps = 0.0f;
  bool bias = false;
  Act act = Act::none;
  bool post_norm = false;
  float post_eps = 0.0f;
  bool residual = false;
  // heads mode (fused_qkv) when q_heads > 0
  int q_heads = 0, kv_heads = 0, head_dim = 0;
  bool qk_norm = false;
  float qk_eps = 0.0f;
  bool rope = false;
  bool traditional = false;
  int kv_type = 0;  // 0 float32, 1 float16, 2 bfloat16
  bool panel = false;  // the matmul through the panel GEMM (gemm.h: long blocks; its own sum order)

  bool operator==(const FusedSpec&) const = default;
};

// x: float [..., K]; wq / scales / mins as q8_0_matmul / q4_1_matmul (mins only for q4_1, uint8 wq).
mx::array fused_linear(const mx::array& x, const mx::array& wq, const mx::array& scales,
                       const std::optional<mx::array>& mins, const std::optional<mx::array>& norm, float eps,
                       const std::optional<mx::array>& bias, const std::string& act,
                       const std::optional<mx::array>& post_norm, float post_eps,
                       const std::optional<mx::array>& residual, bool panel = false,
                       mx::StreamOrDevice s = {});

// -> (q float32 [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D]) with k, v in kv_dtype.
std::tuple<mx::array, mx::array, mx::array> fused_qkv(
    const mx::array& x, const mx::array& wq, const mx::array& scales, const std::optional<mx::array>& mins,
    int q_heads, int kv_heads, int head_dim, const std::optional<mx::array>& norm, float eps,
    const std::optional<mx::array>& bias, const std::optional<mx::array>& q_norm,
    const std::optional<mx::array>& k_norm, float qk_eps, const std::optional<mx::array>& cos,
    const std::optional<mx::array>& sin, bool traditional, mx::Dtype kv_dtype, bool panel = false,
    mx::StreamOrDevice s = {});

// The op's work on evaluated inputs (as FusedLinear's) into outputs with their data set.
void fused_run(const FusedSpec& spec, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs);

class FusedLinear : public mx::Primitive {
 public:
  FusedLinear(mx::Stream stream, FusedSpec spec) : mx::Primitive(stream), spec_(spec) {}

  // inputs: x, wq, scales, [mins], [norm], [bias], [post_norm], [residual], [q_norm, k_norm], [cos, sin]
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return spec_.q_heads > 0 ? "ForklineFusedQKV" : "ForklineFusedLinear";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  const FusedSpec& spec() const {
    return spec_;
  }

 private:
  FusedSpec spec_;
};

}  // namespace forkline
