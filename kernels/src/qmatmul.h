// MLX operations y = x @ W.T for W in a block-quantized format (see qdot.h), evaluated on the CPU by
// the kernels in qdot.cpp over the persistent worker pool.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace forkline {

enum class Format { q8_0 = 0, q4_1 = 1 };

// x: float [..., K]; wq: int8 [N, Kp]; scales: float32 [N, Kp/32]; K <= Kp < K + 32.
// Returns float32 [..., N]. quantize_x: int8 activations (see qdot.h) instead of float; panel: the
// panel GEMM of gemm.h (long blocks; its own summation order) instead of the dot-product kernels.
mx::array q8_0_matmul(const mx::array& x, const mx::array& wq, const mx::array& scales, bool quantize_x,
                      bool panel, mx::StreamOrDevice s = {});

// x: float [..., K]; wq: uint8 [N, Kp/2]; scales, mins: float32 [N, Kp/32]. Returns float32 [..., N].
mx::array q4_1_matmul(const mx::array& x, const mx::array& wq, const mx::array& scales,
                      const mx::array& mins, bool quantize_x, bool panel, mx::StreamOrDevice s = {});

// y[m * ldy + j] = x_m . W_j for m < M, j < N: float rows x [M, blocks * 32] (dense, zero-padded) times
// a q8_0 (wq int8) or q4_1 (wq uint8, mins) matrix [N, blocks * 32], over the worker pool; the float
// kernels of qdot.h, so every output is the one a q8_0_matmul / q4_1_matmul call gives.
void float_rows_matmul(Format format, const float* x, int M, int blocks, int N, const void* wq,
                       const float* scales, const float* mins, float* y, int64_t ldy);

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream stream, Format format, int k, bool quantize_x, bool panel)
      : mx::Primitive(stream), format_(format), k_(k), quantize_x_(quantize_x), panel_(panel) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return format_ == Format::q8_0 ? "ForklineQ8_0Matmul" : "ForklineQ4_1Matmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  Format format_;
  int k_;  // logical input width (x's last dimension); the weights are padded to a multiple of 32
  bool quantize_x_;
  bool panel_;
};

}  // namespace forkline
