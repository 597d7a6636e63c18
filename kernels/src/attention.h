// Batch-invariant causal attention for MLX's CPU backend (forkline's deterministic mode).
//
// For each query row i at absolute position p = q_pos[i] and each q head h (kv head h / (Hq / Hkv)),
// the row attends the keys whose absolute position lies in [max(0, p - window + 1), p] (window 0:
// [0, p]); keys with position -1 (or any negative) are never read. Keys come in one or more parts
// (pool slices, ring buffers, gathers) in any row order: their positions say where each belongs.
//
// The reduction never depends on the call: visible keys are taken in ascending position, in chunks
// of `chunk` positions aligned to multiples of `chunk` (absolute), each chunk merged into an online
// softmax (running max, sum, output) in ascending order. Every dot product, exponential and sum has
// a fixed order (a scalar reference and an AVX2 version, bitwise equal). So a query's output is the
// same whether it is computed alone, in a batch, or in a prefill split anywhere; only its own
// position, its q row and the keys it sees matter. Two visible keys with one position are a caller
// error (both are read, in part then row order).
#pragma once

#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace forkline {

// q: float [n, Hq, D]; q_pos: int [n]; keys[i], values[i]: float [Hkv, S_i, D]; key_pos[i]: int [S_i].
// Returns float32 [n, Hq, D]. Scores are scale * (q . k). A row that sees no key gets NaN.
mx::array causal_attention(const mx::array& q, const mx::array& q_pos, const std::vector<mx::array>& keys,
                           const std::vector<mx::array>& values, const std::vector<mx::array>& key_pos,
                           float scale, int window, int chunk, mx::StreamOrDevice s = {});

class CausalAttention : public mx::Primitive {
 public:
  CausalAttention(mx::Stream stream, float scale, int window, int chunk)
      : mx::Primitive(stream), scale_(scale), window_(window), chunk_(chunk) {}

  // inputs: q, q_pos, then (key_pos, keys, values) per part
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "ForklineCausalAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  int window_;  // 0: unbounded
  int chunk_;  // key positions per online-softmax chunk
};

}  // namespace forkline
