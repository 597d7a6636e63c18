// One decoder layer's new K/V rows written into a step's cache buffers in one operation: a packed
// step of several sequences costs one MLX node per layer instead of transposes, slices and a
// slice_update per sequence (which at 8 sequences were ~17% of a decode step).
//
// The buffers are updated in place when MLX may reuse them (the usual case: the cache holds the
// only reference), otherwise copied first, as slice_update does: the results are the same arrays
// either way, and nothing but the listed rows changes.
#pragma once

#include <tuple>
#include <utility>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace forkline {

// k, v: [T, Hkv, D] (the step's rows, packed); keys[i], values[i]: [Hkv, A_i, D] buffers of k's dtype,
// each a distinct array;
// writes: (buffer, src_row, dst_row, rows): rows k[src_row .. + rows) go to keys[buffer][:, dst_row ..
// + rows, :] (values likewise). Returns the updated (keys, values) buffers, same shapes.
std::pair<std::vector<mx::array>, std::vector<mx::array>> kv_store(
    const mx::array& k, const mx::array& v, const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values, const std::vector<std::tuple<int, int, int, int>>& writes,
    mx::StreamOrDevice s = {});

// The op's parts, for ops that store K/V as one of their steps: outputs[out_first + i] takes over
// inputs[first + i] where MLX allows (-> false) or gets a fresh buffer to copy it into (-> true); then,
// on the evaluated arrays, the copies and the writes (flattened (buffer, src_row, dst_row, rows)) of
// k, v into outputs (keys..., values...), buffers: the inputs they were taken from.
std::vector<bool> take_buffers(const std::vector<mx::array>& inputs, size_t first, std::vector<mx::array>& outputs,
                               size_t out_first);
void kv_store_run(const mx::array& k, const mx::array& v, const std::vector<mx::array>& buffers,
                  std::vector<mx::array>& outputs, const std::vector<bool>& copy, const std::vector<int>& writes);

class KVStore : public mx::Primitive {
 public:
  KVStore(mx::Stream stream, std::vector<int> writes) : mx::Primitive(stream), writes_(std::move(writes)) {}

  // inputs: k, v, keys..., values...; outputs: keys..., values...
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "ForklineKVStore";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  const std::vector<int>& writes() const {
    return writes_;
  }

 private:
  std::vector<int> writes_;  // (buffer, src_row, dst_row, rows) flattened
};

}  // namespace forkline
