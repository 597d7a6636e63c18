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

// The first `rows` rows of buffer [A, B, C] along B, sharing its data.
mx::array leading_rows(const mx::array& buf, int rows) {
  mx::array view({buf.shape(0), rows, buf.shape(2)}, buf.dtype(), nullptr, {});
  auto flags = buf.flags();
  if (rows != buf.shape(1) && buf.shape(0) > 1) {
    flags.row_contiguous = flags.col_contiguous = flags.contiguous = false;
  }
  view.copy_shared_buffer(buf, buf.strides(), flags, buf.data_size());
  return view;
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
      if (part.buffer >= nbuf || part.rows < 1 || part.rows > new_keys[part.buffer].shape(1) || part.keys ||
          part.values) {
        bad("a buffer part needs a buffer index < " + std::to_string(nbuf) +
            ", rows within it and no keys / values of its own");
      }
      const mx::array& kb = new_keys[part.buffer];
      const mx::Shape stop{kb.shape(0), part.rows, kb.shape(2)};
      keys.push_back(mx::slice(kb, {0, 0, 0}, stop, stream));
      values.push_back(mx::slice(new_values[part.buffer], {0, 0, 0}, stop, stream));
    } else {
      if (!part.keys || !part.values) {
        bad("a part without a buffer needs keys and values");
      }
      keys.push_back(*part.keys);
      values.push_back(*part.values);
    }
    key_pos.push_back(part.key_pos);
    P.part_buffer.push_back(part.buffer);
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
      att_in.push_back(leading_rows(outputs[1 + b], P.part_rows[i]));
      att_in.push_back(leading_rows(outputs[1 + nbuf + b], P.part_rows[i]));
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
