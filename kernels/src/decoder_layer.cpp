#include "decoder_layer.h"

#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

#include "attention.h"
#include "common.h"
#include "kv_store.h"

namespace forkline {

namespace {

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("decoder_layer: " + what);
}

// A float array with its own fresh buffer, outside any graph (a stage's result inside the op).
mx::array scratch(mx::Shape shape, mx::Dtype dtype) {
  mx::array a(std::move(shape), dtype, nullptr, {});
  a.set_data(mx::allocator::malloc(a.nbytes()));
  return a;
}

// Rows [start, start + rows) of buffer [A, B, C] along B, sharing its data.
mx::array rows_of(const mx::array& buf, int start, int rows) {
  mx::array view({buf.shape(0), rows, buf.shape(2)}, buf.dtype(), nullptr, {});
  auto flags = buf.flags();
  if (rows != buf.shape(1) && buf.shape(0) > 1) {
    flags.row_contiguous = flags.col_contiguous = flags.contiguous = false;
  }
  const int64_t offset = static_cast<int64_t>(start) * buf.strides()[1];
  view.copy_shared_buffer(buf, buf.strides(), flags, buf.data_size() - offset, offset);
  return view;
}

// Whether a buffer part's rows lie inside its buffer (of `alloc` rows).
bool inside(const AttentionPart& part, int alloc) {
  return part.start >= 0 && part.rows >= 1 && part.start + part.rows <= alloc && !part.keys && !part.values;
}

template <class P>
const P& primitive_of(const mx::array& a) {
  return static_cast<const P&>(a.primitive());
}

// Appends inputs [from, size - drop_last) of `a` to `to`; -> where they start and how many.
std::pair<int, int> append_inputs(const mx::array& a, int from, int drop_last, std::vector<mx::array>& to) {
  const auto& in = a.inputs();
  const int at = static_cast<int>(to.size());
  to.insert(to.end(), in.begin() + from, in.end() - drop_last);
  return {at, static_cast<int>(in.size()) - from - drop_last};
}

}  // namespace

std::tuple<mx::array, std::vector<mx::array>, std::vector<mx::array>> decoder_layer(const DecoderLayerArgs& a,
                                                                                  mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    bad("CPU streams only");
  }
  if (a.h.ndim() != 2) {
    bad("h must be [T, hidden], got " + shape_str(a.h));
  }
  if (a.key_buffers.empty()) {
    bad("key_buffers must not be empty");
  }
  // The six ops, built (and so checked) as the unfused layer builds them, never evaluated: the layer
  // op takes their specs and inputs.
  const mx::Dtype kv_dtype = a.key_buffers[0].dtype();
  auto [q, k, v] = fused_qkv(a.h, a.qkv.wq, a.qkv.scales, a.qkv.mins, a.q_heads, a.kv_heads, a.head_dim, a.attn_norm,
                             a.eps, a.qkv_bias, a.q_norm, a.k_norm, a.eps, a.cos, a.sin, a.traditional, kv_dtype,
                             a.panel, stream);
  auto [new_keys, new_values] = kv_store(k, v, a.key_buffers, a.value_buffers, a.writes, stream);
  std::vector<mx::array> keys, values, key_pos;
  DecoderLayerOp::Plan P;
  const int nbuf = static_cast<int>(new_keys.size());
  for (const AttentionPart& part : a.parts) {
    if (part.buffer >= 0) {
      if (part.buffer >= nbuf || !inside(part, new_keys[part.buffer].shape(1))) {
        bad("a buffer part needs a buffer index < " + std::to_string(nbuf) +
            ", rows within it and no keys / values of its own");
      }
      const mx::array& kb = new_keys[part.buffer];
      const mx::Shape start{0, part.start, 0}, stop{kb.shape(0), part.start + part.rows, kb.shape(2)};
      keys.push_back(mx::slice(kb, start, stop, stream));
      values.push_back(mx::slice(new_values[part.buffer], start, stop, stream));
    } else {
      if (!part.keys || !part.values) {
        bad("a part without a buffer needs keys and values");
      }
      keys.push_back(*part.keys);
      values.push_back(*part.values);
    }
    key_pos.push_back(part.key_pos);
    P.part_buffer.push_back(part.buffer);
    P.part_start.push_back(part.start);
    P.part_rows.push_back(part.rows);
  }
  mx::array att = causal_attention(q, a.q_pos, keys, values, key_pos, a.scale, a.window, a.chunk, a.groups, stream);
  const int t = a.h.shape(0);
  mx::array flat = mx::reshape(att, {t, a.q_heads * a.head_dim}, stream);
  mx::array h1 = fused_linear(flat, a.o.wq, a.o.scales, a.o.mins, std::nullopt, 0.0f, a.o_bias, "", a.post_attn_norm,
                              a.eps, a.h, a.panel, stream);
  mx::array m = fused_linear(h1, a.gate_up.wq, a.gate_up.scales, a.gate_up.mins, a.mlp_norm, a.eps, a.gate_up_bias,
                             a.act, std::nullopt, 0.0f, std::nullopt, a.panel, stream);
  mx::array out = fused_linear(m, a.down.wq, a.down.scales, a.down.mins, std::nullopt, 0.0f, a.down_bias, "",
                               a.post_mlp_norm, a.eps, h1, a.panel, stream);

  const auto& att_op = primitive_of<CausalAttention>(att);
  const auto& att_in = att.inputs();
  for (size_t i = 0; i < a.parts.size(); ++i) {  // a buffer part's keys must be read as stored
    if (P.part_buffer[i] >= 0 && (att_in[3 + 3 * i].id() != keys[i].id() || att_in[4 + 3 * i].id() != values[i].id())) {
      bad("every part's keys and values must have the buffers' dtype");
    }
  }
  std::vector<mx::array> inputs{q.inputs()[0]};
  P.qkv = primitive_of<FusedLinear>(q).spec();
  P.o = primitive_of<FusedLinear>(h1).spec();
  P.gate_up = primitive_of<FusedLinear>(m).spec();
  P.down = primitive_of<FusedLinear>(out).spec();
  std::tie(P.qkv_at, P.qkv_n) = append_inputs(q, 1, 0, inputs);
  std::tie(P.o_at, P.o_n) = append_inputs(h1, 1, 1, inputs);
  std::tie(P.gate_up_at, P.gate_up_n) = append_inputs(m, 1, 0, inputs);
  std::tie(P.down_at, P.down_n) = append_inputs(out, 1, 1, inputs);
  P.q_pos_at = static_cast<int>(inputs.size());
  inputs.push_back(att_in[1]);
  P.parts_at = static_cast<int>(inputs.size());
  for (size_t i = 0; i < a.parts.size(); ++i) {
    inputs.push_back(att_in[2 + 3 * i]);
    if (P.part_buffer[i] < 0) {
      inputs.push_back(att_in[3 + 3 * i]);
      inputs.push_back(att_in[4 + 3 * i]);
    }
  }
  std::tie(P.buffers_at, P.buffers) = append_inputs(new_keys[0], 2, 0, inputs);
  P.buffers /= 2;
  P.writes = primitive_of<KVStore>(new_keys[0]).writes();
  P.scale = att_op.scale();
  P.window = att_op.window();
  P.chunk = att_op.chunk();
  P.groups = att_op.groups();
  P.hq = a.q_heads;
  P.hkv = a.kv_heads;
  P.d = a.head_dim;
  P.inter = m.shape(1);

  std::vector<mx::Shape> shapes{out.shape()};
  std::vector<mx::Dtype> dtypes{mx::float32};
  for (const auto* group : {&new_keys, &new_values}) {
    for (const mx::array& b : *group) {
      shapes.push_back(b.shape());
      dtypes.push_back(b.dtype());
    }
  }
  auto outs = mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                     std::make_shared<DecoderLayerOp>(stream, std::move(P)), std::move(inputs));
  return {outs[0], std::vector<mx::array>(outs.begin() + 1, outs.begin() + 1 + nbuf),
          std::vector<mx::array>(outs.begin() + 1 + nbuf, outs.end())};
}

struct DecoderLayerCall::Template {
  DecoderLayerOp::Plan plan;
  std::vector<mx::array> fixed;  // the op's inputs [1, q_pos_at): the stages' own, the RoPE tables' places
  int cos_at;  // where the tables go in the op's inputs (-1: no RoPE)
  mx::Dtype kv;
  int hidden;
};

std::tuple<mx::array, std::vector<mx::array>, std::vector<mx::array>> DecoderLayerCall::operator()(
    const mx::array& h, const std::optional<mx::array>& cos, const std::optional<mx::array>& sin,
    std::vector<mx::array> key_buffers, std::vector<mx::array> value_buffers,
    std::vector<std::tuple<int, int, int, int>> writes, const mx::array& q_pos, std::vector<AttentionPart> parts,
    std::vector<std::tuple<int, int, int>> groups, bool panel, mx::StreamOrDevice s) {
  if (key_buffers.empty()) {
    bad("key_buffers must not be empty");
  }
  if (!template_ || template_->kv != key_buffers[0].dtype()) {  // built and checked in full, then kept
    DecoderLayerArgs& a = args_;
    a.h = h, a.cos = cos, a.sin = sin, a.q_pos = q_pos, a.panel = panel;
    a.key_buffers = std::move(key_buffers), a.value_buffers = std::move(value_buffers);
    a.writes = std::move(writes), a.parts = std::move(parts), a.groups = std::move(groups);
    auto out = decoder_layer(a, s);
    // hold no array of a step between calls (a buffer held is never updated in place)
    a.h = a.q_pos = mx::array(0);
    a.cos = a.sin = std::nullopt;
    a.key_buffers.clear(), a.value_buffers.clear(), a.parts.clear();
    const auto& op = primitive_of<DecoderLayerOp>(std::get<0>(out));
    const DecoderLayerOp::Plan& P = op.plan();
    const auto& in = std::get<0>(out).inputs();
    template_ = std::make_shared<Template>(Template{P, std::vector<mx::array>(in.begin() + 1, in.begin() + P.q_pos_at),
                                                    cos ? P.qkv_at + P.qkv_n - 2 : -1, in[P.buffers_at].dtype(),
                                                    in[0].shape(1)});
    return out;
  }
  const Template& T = *template_;
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    bad("CPU streams only");
  }
  if (h.ndim() != 2 || h.shape(1) != T.hidden || !mx::issubdtype(h.dtype(), mx::floating)) {
    bad("h must be a float array [T, " + std::to_string(T.hidden) + "], got " + shape_str(h));
  }
  const int t = h.shape(0), hkv = T.plan.hkv, d = T.plan.d;
  std::vector<mx::array> inputs{mx::astype(h, mx::float32, stream)};
  inputs.insert(inputs.end(), T.fixed.begin(), T.fixed.end());
  if (cos.has_value() != (T.cos_at >= 0) || sin.has_value() != cos.has_value()) {
    bad("cos and sin must be given exactly when the layer was first called with them");
  }
  if (cos) {
    for (const mx::array* table : {&*cos, &*sin}) {
      if (static_cast<int64_t>(table->size()) != static_cast<int64_t>(t) * d || table->shape(-1) != d) {
        bad("cos / sin must hold [" + std::to_string(t) + ", " + std::to_string(d) + "] values, got " + shape_str(*table));
      }
    }
    inputs[T.cos_at] = mx::astype(*cos, mx::float32, stream);
    inputs[T.cos_at + 1] = mx::astype(*sin, mx::float32, stream);
  }
  if (q_pos.ndim() != 1 || q_pos.shape(0) != t || !mx::issubdtype(q_pos.dtype(), mx::integer)) {
    bad("q_pos must be an int array [" + std::to_string(t) + "], got " + shape_str(q_pos));
  }
  inputs.push_back(mx::astype(q_pos, mx::int32, stream));
  const int nbuf = static_cast<int>(key_buffers.size());
  if (value_buffers.size() != key_buffers.size()) {
    bad("key_buffers and value_buffers must have one length");
  }
  for (int i = 0; i < 2 * nbuf; ++i) {
    const mx::array& b = i < nbuf ? key_buffers[i] : value_buffers[i - nbuf];
    if (b.ndim() != 3 || b.shape(0) != hkv || b.shape(2) != d || b.dtype() != T.kv ||
        b.shape(1) != key_buffers[i % nbuf].shape(1)) {
      bad("buffers must be [" + std::to_string(hkv) + ", A, " + std::to_string(d) + "] of the layer's K/V dtype, got " +
          shape_str(b));
    }
    for (int j = 0; j < i; ++j) {
      if (b.id() == (j < nbuf ? key_buffers[j] : value_buffers[j - nbuf]).id()) {
        bad("every buffer must be a distinct array");
      }
    }
  }
  DecoderLayerOp::Plan P = T.plan;
  P.writes.clear();
  for (const auto& [buffer, src, dst, rows] : writes) {
    if (buffer < 0 || buffer >= nbuf || rows < 1 || src < 0 || src + rows > t || dst < 0 ||
        dst + rows > key_buffers[buffer].shape(1)) {
      bad("write (" + std::to_string(buffer) + ", " + std::to_string(src) + ", " + std::to_string(dst) + ", " +
          std::to_string(rows) + ") is outside h's rows or its buffer");
    }
    P.writes.insert(P.writes.end(), {buffer, src, dst, rows});
  }
  P.parts_at = static_cast<int>(inputs.size());
  P.part_buffer.clear();
  P.part_start.clear();
  P.part_rows.clear();
  for (const AttentionPart& part : parts) {
    int rows = part.rows;
    if (part.buffer >= 0) {
      if (part.buffer >= nbuf || !inside(part, key_buffers[part.buffer].shape(1))) {
        bad("a buffer part needs a buffer index < " + std::to_string(nbuf) +
            ", rows within it and no keys / values of its own");
      }
    } else {
      if (!part.keys || !part.values || part.keys->ndim() != 3 || part.keys->shape() != part.values->shape() ||
          part.keys->shape(0) != hkv || part.keys->shape(2) != d || part.keys->dtype() != T.kv ||
          part.values->dtype() != T.kv) {
        bad("a part without a buffer needs keys and values [" + std::to_string(hkv) + ", S, " + std::to_string(d) +
            "] of the buffers' dtype");
      }
      rows = part.keys->shape(1);
    }
    const mx::array& kp = part.key_pos;
    if (kp.ndim() != 1 || kp.shape(0) != rows || !mx::issubdtype(kp.dtype(), mx::integer)) {
      bad("key_pos must be an int array [" + std::to_string(rows) + "], got " + shape_str(kp));
    }
    inputs.push_back(mx::astype(kp, mx::int32, stream));
    if (part.buffer < 0) {
      inputs.push_back(*part.keys);
      inputs.push_back(*part.values);
    }
    P.part_buffer.push_back(part.buffer);
    P.part_start.push_back(part.start);
    P.part_rows.push_back(part.rows);
  }
  if (parts.empty()) {
    bad("parts must not be empty");
  }
  P.groups = checked_groups("decoder_layer", groups, t, parts.size());
  P.buffers_at = static_cast<int>(inputs.size());
  P.buffers = nbuf;
  inputs.insert(inputs.end(), key_buffers.begin(), key_buffers.end());
  inputs.insert(inputs.end(), value_buffers.begin(), value_buffers.end());
  P.qkv.panel = P.o.panel = P.gate_up.panel = P.down.panel = panel;
  std::vector<mx::Shape> shapes{{t, T.hidden}};
  std::vector<mx::Dtype> dtypes{mx::float32};
  for (int i = 0; i < 2 * nbuf; ++i) {
    shapes.push_back(inputs[P.buffers_at + i].shape());
    dtypes.push_back(T.kv);
  }
  auto outs = mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                     std::make_shared<DecoderLayerOp>(stream, std::move(P)), std::move(inputs));
  return {outs[0], std::vector<mx::array>(outs.begin() + 1, outs.begin() + 1 + nbuf),
          std::vector<mx::array>(outs.begin() + 1 + nbuf, outs.end())};
}

void DecoderLayerOp::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const Plan& P = plan_;
  for (int at : {P.qkv_at, P.o_at, P.gate_up_at, P.down_at}) {
    for (int i = at; i < at + 2; ++i) {
      if (!inputs[i].flags().row_contiguous) {
        bad("quantized weights must be row-contiguous");
      }
    }
  }
  const std::vector<bool> copy = take_buffers(inputs, P.buffers_at, outputs, 1);
  outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
  const int t = inputs[0].shape(0);
  const mx::Dtype kv_dtype = outputs[1].dtype();
  mx::array q = scratch({t, P.hq, P.d}, mx::float32);
  mx::array k = scratch({t, P.hkv, P.d}, kv_dtype);
  mx::array v = scratch({t, P.hkv, P.d}, kv_dtype);
  mx::array att = scratch({t, P.hq * P.d}, mx::float32);
  mx::array h1 = scratch({t, outputs[0].shape(1)}, mx::float32);
  mx::array m = scratch({t, P.inter}, mx::float32);
  // each stage's inputs as its own op would have them: x, its own, then the residual
  auto stage = [&](const mx::array& x, int at, int n, const mx::array* residual) {
    std::vector<mx::array> in{x};
    in.insert(in.end(), inputs.begin() + at, inputs.begin() + at + n);
    if (residual != nullptr) {
      in.push_back(*residual);
    }
    return in;
  };
  std::vector<mx::array> qkv_in = stage(inputs[0], P.qkv_at, P.qkv_n, nullptr);
  std::vector<mx::array> o_in = stage(att, P.o_at, P.o_n, &inputs[0]);
  std::vector<mx::array> gate_up_in = stage(h1, P.gate_up_at, P.gate_up_n, nullptr);
  std::vector<mx::array> down_in = stage(m, P.down_at, P.down_n, &h1);
  // the attention reads the buffers as the store leaves them: views of the outputs
  const int nbuf = P.buffers;
  std::vector<mx::array> att_in{q, inputs[P.q_pos_at]};
  int at = P.parts_at;
  for (size_t i = 0; i < P.part_buffer.size(); ++i) {
    att_in.push_back(inputs[at++]);
    const int b = P.part_buffer[i];
    if (b >= 0) {
      att_in.push_back(rows_of(outputs[1 + b], P.part_start[i], P.part_rows[i]));
      att_in.push_back(rows_of(outputs[1 + nbuf + b], P.part_start[i], P.part_rows[i]));
    } else {
      att_in.push_back(inputs[at++]);
      att_in.push_back(inputs[at++]);
    }
  }
  const std::vector<mx::array> buffers(inputs.begin() + P.buffers_at, inputs.begin() + P.buffers_at + 2 * nbuf);
  std::vector<mx::array> stored(outputs.begin() + 1, outputs.end());
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // The task holds its own references to the arrays until it has run.
  encoder.dispatch([P, copy, out = outputs[0], q, k, v, att, h1, m, qkv_in = std::move(qkv_in), o_in = std::move(o_in),
                    gate_up_in = std::move(gate_up_in), down_in = std::move(down_in), att_in = std::move(att_in),
                    buffers, stored]() mutable {
    std::vector<mx::array> qkv_out{q, k, v}, h1_out{h1}, m_out{m}, h_out{out};
    fused_run(P.qkv, qkv_in, qkv_out);
    kv_store_run(k, v, buffers, stored, copy, P.writes);
    attention_run(att_in, att.data<float>(), P.scale, P.window, P.chunk, P.groups);
    fused_run(P.o, o_in, h1_out);
    fused_run(P.gate_up, gate_up_in, m_out);
    fused_run(P.down, down_in, h_out);
  });
}

void DecoderLayerOp::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("ForklineDecoderLayer has no GPU implementation");
}

std::vector<mx::Shape> DecoderLayerOp::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> out{{inputs[0].shape(0), inputs[0].shape(1)}};
  for (int i = 0; i < 2 * plan_.buffers; ++i) {
    out.push_back(inputs[plan_.buffers_at + i].shape());
  }
  return out;
}

bool DecoderLayerOp::is_equivalent(const mx::Primitive& other) const {
  return plan_ == static_cast<const DecoderLayerOp&>(other).plan_;
}

}  // namespace forkline
