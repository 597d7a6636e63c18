// Batch-invariant causal attention for MLX's CPU backend (forkline's deterministic mode; also the
// fastest decode attention here: 2.4-4x MLX's fused attention at one query row, bench_kernels_attention).
//
// For each query row i at absolute position p = q_pos[i] and each q head h (kv head h / (Hq / Hkv)),
// the row attends the keys whose absolute position lies in [max(0, p - window + 1), p] (window 0:
// [0, p]); keys with position -1 (or any negative) are never read. Keys come in one or more parts
// (pool slices, ring buffers, gathers) in any row order: their positions say where each belongs.
// Keys / values may be float32, float16 or bfloat16 (one type for all parts; mixed types are read as
// float32): half types are widened on load, exactly, so the result is bitwise the float32 kernel's on
// the upcast values while reading half the bytes.
//
// The reduction never depends on the call. Visible keys are taken in ascending position, in chunks of
// `chunk` positions aligned to multiples of `chunk` (absolute). Each chunk gives a partial softmax
// (m = max score, l = sum of e = exp(score - m), o = sum of e * v), and the partials are folded in
// ascending chunk order: M' = max(M, m), a = exp(M - M'), b = exp(m - M'), L = fma(l, b, L * a),
// O = fma(o, b, O * a); out = O / L. Every dot product, exponential and sum has a fixed order (a
// scalar reference, AVX2 and AVX-512 versions, bitwise equal: the AVX-512 one only shares more loads,
// sums four keys' lanes at once with the same pairs, and holds values in 16-float registers). A query's output is the same whether computed
// alone, in a batch, in a prefill split anywhere, or with its chunks spread over threads (decode rows
// with few kv heads are: each thread computes some chunks' partials, the fold runs in order after).
// Two visible keys with one position are a caller error (both are read, in part then row order).
#pragma once

#include <tuple>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace forkline {

// q: float [n, Hq, D]; q_pos: int [n]; keys[i], values[i]: float32 / float16 / bfloat16 [Hkv, S_i, D];
// key_pos[i]: int [S_i]. Returns float32 [n, Hq, D]. Scores are scale * (q . k). A row that sees no
// key gets NaN.
// groups (optional): (row_start, row_stop, parts) in row order, parts listed group by group: the rows
// [row_start, row_stop) read only their group's parts (several sequences' views in one call, e.g. a
// batched decode step). Empty: every row reads every part. The grouping never changes a row's result.
mx::array causal_attention(const mx::array& q, const mx::array& q_pos, const std::vector<mx::array>& keys,
                           const std::vector<mx::array>& values, const std::vector<mx::array>& key_pos,
                           float scale, int window, int chunk,
                           const std::vector<std::tuple<int, int, int>>& groups = {}, mx::StreamOrDevice s = {});

// groups checked (in row order, covering `rows` rows and `parts` parts) and flattened; empty stays empty.
std::vector<int> checked_groups(const char* op, const std::vector<std::tuple<int, int, int>>& groups, int rows,
                                size_t parts);

// The op's work on evaluated inputs (q, q_pos, then (key_pos, keys, values) per part, as the op's)
// into out_data [n, Hq, D]; groups flattened (row_start, row_stop, parts), empty: one group.
void attention_run(const std::vector<mx::array>& inputs, float* out_data, float scale, int window, int chunk,
                   const std::vector<int>& groups);

class CausalAttention : public mx::Primitive {
 public:
  CausalAttention(mx::Stream stream, float scale, int window, int chunk, std::vector<int> groups = {})
      : mx::Primitive(stream), scale_(scale), window_(window), chunk_(chunk), groups_(std::move(groups)) {}

  // inputs: q, q_pos, then (key_pos, keys, values) per part
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "ForklineCausalAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  float scale() const {
    return scale_;
  }
  int window() const {
    return window_;
  }
  int chunk() const {
    return chunk_;
  }
  const std::vector<int>& groups() const {
    return groups_;
  }

 private:
  float scale_;
  int window_;  // 0: unbounded
  int chunk_;  // key positions per online-softmax chunk
  std::vector<int> groups_;  // (row_start, row_stop, parts) flattened; empty: one group
};

}  // namespace forkline
