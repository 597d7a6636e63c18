// One decoder layer as one MLX op: fused_qkv, kv_store, causal_attention and the three fused_linear ops
// (o + residual, norm + gate/up, down + residual) run in that order inside one task, on the same
// kernels with the same arguments as the six ops, so every value is bitwise theirs. A decode step
// then costs one graph node a layer instead of ~10: the node count, not the kernels, was what the
// graph build and evaluation spent the main thread on, and on two cores that thread competes with
// the kernel threads (docs/ENGINE.md: the layer op).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "fused.h"

namespace mx = mlx::core;

namespace forkline {

// A block-quantized matrix: wq, scales, mins (q4_1 only).
struct BlockWeights {
  mx::array wq, scales;
  std::optional<mx::array> mins;
};

// One part of the attention's keys: buffer >= 0: rows [start, start + rows) of that K/V buffer after
// the layer's store; buffer < 0: keys / values given. key_pos: int [rows or the given keys' rows].
struct AttentionPart {
  int buffer;
  int start, rows;
  std::optional<mx::array> keys, values;
  mx::array key_pos;
};

struct DecoderLayerArgs {
  mx::array h;  // [T, hidden]
  // fused_qkv
  BlockWeights qkv;
  int q_heads, kv_heads, head_dim;
  std::optional<mx::array> attn_norm;
  float eps;
  std::optional<mx::array> qkv_bias, q_norm, k_norm;
  std::optional<mx::array> cos, sin;
  bool traditional;
  // kv_store: buffers [kv_heads, A_i, head_dim] (the K/V dtype), writes (buffer, src_row, dst_row, rows)
  std::vector<mx::array> key_buffers, value_buffers;
  std::vector<std::tuple<int, int, int, int>> writes;
  // causal_attention
  mx::array q_pos;
  std::vector<AttentionPart> parts;
  std::vector<std::tuple<int, int, int>> groups;
  float scale;
  int window, chunk;
  // o (+ post_attn_norm) + residual h; mlp_norm + gate_up + act; down (+ post_mlp_norm) + residual
  BlockWeights o;
  std::optional<mx::array> o_bias, post_attn_norm;
  BlockWeights gate_up;
  std::optional<mx::array> mlp_norm, gate_up_bias;
  std::string act;
  BlockWeights down;
  std::optional<mx::array> down_bias, post_mlp_norm;
  bool panel;
};

// -> (h' [T, hidden] float32, the updated key buffers, the updated value buffers), in place where MLX
// allows (as kv_store). Arguments are checked as the six ops check them.
std::tuple<mx::array, std::vector<mx::array>, std::vector<mx::array>> decoder_layer(const DecoderLayerArgs& a,
                                                                                  mx::StreamOrDevice s = {});

class DecoderLayerOp;

// A layer's fixed arguments (weights, norms, shapes, scale, window, chunk: `constants`, whose per-call
// fields are ignored) held for its calls. The first call (and one with another K/V dtype) builds the op
// as decoder_layer() does; later calls check only what changes per call (h, the tables, buffers,
// writes, positions, parts, groups) and reuse the rest, ~4x cheaper to build.
class DecoderLayerCall {
 public:
  explicit DecoderLayerCall(DecoderLayerArgs constants) : args_(std::move(constants)) {}
  std::tuple<mx::array, std::vector<mx::array>, std::vector<mx::array>> operator()(
      const mx::array& h, const std::optional<mx::array>& cos, const std::optional<mx::array>& sin,
      std::vector<mx::array> key_buffers, std::vector<mx::array> value_buffers,
      std::vector<std::tuple<int, int, int, int>> writes, const mx::array& q_pos, std::vector<AttentionPart> parts,
      std::vector<std::tuple<int, int, int>> groups, bool panel, mx::StreamOrDevice s = {});

 private:
  struct Template;
  DecoderLayerArgs args_;
  std::shared_ptr<Template> template_;
};

class DecoderLayerOp : public mx::Primitive {
 public:
  struct Plan {
    FusedSpec qkv, o, gate_up, down;
    std::vector<int> writes;  // (buffer, src_row, dst_row, rows) flattened
    float scale;
    int window, chunk;
    std::vector<int> groups;
    std::vector<int> part_buffer, part_start, part_rows;  // per attention part (buffer -1: given keys)
    // where each stage's inputs (after x, before the residual) start in the op's inputs, and how many
    int qkv_at, qkv_n, o_at, o_n, gate_up_at, gate_up_n, down_at, down_n;
    int q_pos_at, parts_at, buffers_at, buffers;
    int hq, hkv, d, inter;
    bool operator==(const Plan&) const = default;
  };
  DecoderLayerOp(mx::Stream stream, Plan plan) : mx::Primitive(stream), plan_(std::move(plan)) {}

  // inputs: h, each stage's own inputs, q_pos, per part key_pos (+ keys, values when given), key
  // buffers, value buffers; outputs: h', key buffers, value buffers
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  const char* name() const override {
    return "ForklineDecoderLayer";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  const Plan& plan() const {
    return plan_;
  }

 private:
  Plan plan_;
};

}  // namespace forkline
