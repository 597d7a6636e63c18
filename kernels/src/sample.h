// Categorical draws by the inverse of the cumulative distribution: one uniform number per row instead
// of one Gumbel draw per vocabulary entry (MLX's categorical on the CPU: ~1.5 ms a row at 49k entries,
// most of a small model's decode step; this kernel: ~0.05 ms).
//
// Row r of logits x [R, V] (float32), its uniform u_r in [0, 1) and the inverse temperature t:
//   m = max_j x_j;  p_j = 1 where x_j == m, else e**((x_j - m) * t) (vmath's exp: 0 below -87 and for -inf);
//   the token is the first i with  sum_{j <= i} p_j > u_r * sum_j p_j.
// The sums are fixed: p in blocks of 64, each block's sum over 8 lanes (lane l adds entries l, l + 8, ...
// in order, then reduce8's order), the blocks' sums added in float64 in order; the crossing block is then
// walked entry by entry in float64 from the blocks before it. Scalar and AVX2 agree bit for bit, and a row's
// token depends only on that row and its uniform (any batch, thread or ISA). An entry with p_j = 0 (masked,
// -inf) is never drawn.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace forkline {

// logits float32 [R, V] (V >= 1), uniforms float32 [R] -> int32 [R].
mx::array categorical(const mx::array& logits, const mx::array& uniforms, float inv_temperature,
                      mx::StreamOrDevice s = {});

// One row (for tests): the token drawn from x[0 .. V) with uniform u.
int categorical_row(const float* x, int V, float inv_temperature, float u);

class Categorical : public mx::Primitive {
 public:
  Categorical(mx::Stream stream, float inv_temperature) : mx::Primitive(stream), inv_t_(inv_temperature) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "ForklineCategorical";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float inv_t_;
};

}  // namespace forkline
