// Python bindings: only argument conversion; the work is in qmatmul.cpp and qdot.cpp.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "attention.h"
#include "decoder_layer.h"
#include "fused.h"
#include "kv_store.h"
#include "pool.h"
#include "qdot.h"
#include "qmatmul.h"
#include "sample.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using PartTuple = std::tuple<int, int, int, std::optional<mx::array>, std::optional<mx::array>, mx::array>;

forkline::BlockWeights block_weights(const nb::tuple& t, const char* what) {
  if (t.size() != 3) {
    throw std::invalid_argument(std::string("decoder_layer: ") + what + " must be (wq, scales, mins)");
  }
  std::optional<mx::array> mins;
  if (!t[2].is_none()) {
    mins = nb::cast<mx::array>(t[2]);
  }
  return forkline::BlockWeights{nb::cast<mx::array>(t[0]), nb::cast<mx::array>(t[1]), mins};
}

std::vector<forkline::AttentionPart> attention_parts(const std::vector<PartTuple>& parts) {
  std::vector<forkline::AttentionPart> out;
  out.reserve(parts.size());
  for (const auto& [buffer, start, rows, keys, values, key_pos] : parts) {
    out.push_back({buffer, start, rows, keys, values, key_pos});
  }
  return out;
}

}  // namespace

#ifndef FORKLINE_MLX_VERSION
#error "FORKLINE_MLX_VERSION must name the mlx version the extension is built against"
#endif

NB_MODULE(_ext, m) {
  m.doc() = "forkline's quantized matmul kernels for MLX's CPU backend";
  m.attr("built_with_mlx") = FORKLINE_MLX_VERSION;
  m.attr("attention_groups") = true;
  // Bumped whenever a kernel's float operations (and so its results' last bits) change: part of the
  // engine fingerprint, so snapshots computed by other arithmetic are never mixed in. 2: the float
  // matmuls' 16-lane block arithmetic; 3: their weight blocks scaled before the FMAs (see qdot.h); 4: long
  // blocks through the panel GEMM (gemm.h) where BLAS ran.
  m.attr("arithmetic_version") = 4;  // causal_attention takes groups= (several sequences in one call)

  m.def("q8_0_matmul", &forkline::q8_0_matmul, "x"_a, "wq"_a, "scales"_a, nb::kw_only(),
        "quantize_x"_a = false, "panel"_a = false, "stream"_a = nb::none(),
        "x [..., K] @ W.T for q8_0 weights W (wq int8 [N, Kp], scales float32 [N, Kp/32]) -> float32 [..., N]");
  m.def("q4_1_matmul", &forkline::q4_1_matmul, "x"_a, "wq"_a, "scales"_a, "mins"_a, nb::kw_only(),
        "quantize_x"_a = false, "panel"_a = false, "stream"_a = nb::none(),
        "x [..., K] @ W.T for q4_1 weights W (wq uint8 [N, Kp/2], scales/mins float32 [N, Kp/32])");

  m.def("fused_linear", &forkline::fused_linear, "x"_a, "wq"_a, "scales"_a, "mins"_a = nb::none(), nb::kw_only(),
        "norm"_a = nb::none(), "eps"_a = 0.0f, "bias"_a = nb::none(), "act"_a = "", "post_norm"_a = nb::none(),
        "post_eps"_a = 0.0f, "residual"_a = nb::none(), "panel"_a = false, "stream"_a = nb::none(),
        "x [..., K] @ W.T for q8_0 (int8 wq) / q4_1 (uint8 wq, mins) weights with the layer's elementwise work "
        "fused (see src/fused.h): rms_norm(x) * norm first; then + bias, act(gate) * up ('silu' / "
        "'gelu_tanh': the first half of the outputs gates the second), rms_norm(.) * post_norm, residual + .");
  m.def("fused_qkv", &forkline::fused_qkv, "x"_a, "wq"_a, "scales"_a, "mins"_a = nb::none(), nb::kw_only(),
        "q_heads"_a, "kv_heads"_a, "head_dim"_a, "norm"_a = nb::none(), "eps"_a = 0.0f, "bias"_a = nb::none(),
        "q_norm"_a = nb::none(), "k_norm"_a = nb::none(), "qk_eps"_a = 0.0f, "cos"_a = nb::none(),
        "sin"_a = nb::none(), "traditional"_a = false, "kv_dtype"_a = mx::float32, "panel"_a = false,
        "stream"_a = nb::none(),
        "the fused q/k/v projection (see src/fused.h) -> (q float32 [..., q_heads, head_dim], k, v [..., "
        "kv_heads, head_dim] in kv_dtype): rms_norm(x) * norm, x @ W.T (+ bias), per-head QK-norm, RoPE "
        "by the tables cos / sin [rows, head_dim] (out = x * cos + swap(x) * sin)");

  m.def("causal_attention", &forkline::causal_attention, "q"_a, "q_pos"_a, "keys"_a, "values"_a, "key_pos"_a,
        nb::kw_only(), "scale"_a, "window"_a = 0, "chunk"_a = 64,
        "groups"_a = std::vector<std::tuple<int, int, int>>{}, "stream"_a = nb::none(),
        "batch-invariant causal attention (see src/attention.h): q [n, Hq, D], q_pos int32 [n], lists of "
        "keys/values [Hkv, S_i, D] (float32, float16 or bfloat16, read as stored) and key_pos int32 [S_i] "
        "(-1: never read) -> float32 [n, Hq, D]; groups: (row_start, row_stop, parts) per group of rows, in "
        "order (several sequences in one call: each group's rows read only its parts)");

  m.def("kv_store", &forkline::kv_store, "k"_a, "v"_a, "keys"_a, "values"_a, "writes"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "one layer's new K/V rows into cache buffers (see src/kv_store.h): k, v [T, kv_heads, head_dim]; lists "
        "of buffers keys / values [kv_heads, A_i, head_dim] in k's dtype; writes (buffer, src_row, dst_row, "
        "rows) -> the updated (keys, values) lists, in place where MLX allows");

  nb::class_<forkline::DecoderLayerCall>(
      m, "DecoderLayer",
      "one decoder layer as one op, its fixed arguments held for its calls (see src/decoder_layer.h): "
      "DecoderLayer(qkv, q_heads=..., ..., down=...)(h, cos, sin, key_buffers, value_buffers, writes, q_pos, "
      "parts, groups, panel) -> (h', keys, values): fused_qkv, kv_store into the buffers, causal_attention "
      "over parts (buffer, start, rows, keys, values, key_pos) -- buffer >= 0: those rows of that buffer "
      "after the store -- then o + residual, norm + gate/up, down + residual")
      .def(
          "__init__",
          [](forkline::DecoderLayerCall* self, const nb::tuple& qkv, int q_heads, int kv_heads, int head_dim,
             std::optional<mx::array> attn_norm, float eps, std::optional<mx::array> qkv_bias,
             std::optional<mx::array> q_norm, std::optional<mx::array> k_norm, bool traditional, float scale,
             int window, int chunk, const nb::tuple& o, std::optional<mx::array> o_bias,
             std::optional<mx::array> post_attn_norm, const nb::tuple& gate_up, std::optional<mx::array> mlp_norm,
             std::optional<mx::array> gate_up_bias, const std::string& act, const nb::tuple& down,
             std::optional<mx::array> down_bias, std::optional<mx::array> post_mlp_norm) {
            new (self) forkline::DecoderLayerCall(forkline::DecoderLayerArgs{
                mx::array(0), block_weights(qkv, "qkv"), q_heads, kv_heads, head_dim, attn_norm, eps, qkv_bias,
                q_norm, k_norm, std::nullopt, std::nullopt, traditional, {}, {}, {}, mx::array(0), {}, {}, scale,
                window, chunk, block_weights(o, "o"), o_bias, post_attn_norm, block_weights(gate_up, "gate_up"),
                mlp_norm, gate_up_bias, act, block_weights(down, "down"), down_bias, post_mlp_norm, false});
          },
          "qkv"_a, nb::kw_only(), "q_heads"_a, "kv_heads"_a, "head_dim"_a, "attn_norm"_a = nb::none(),
          "eps"_a = 0.0f, "qkv_bias"_a = nb::none(), "q_norm"_a = nb::none(), "k_norm"_a = nb::none(),
          "traditional"_a = false, "scale"_a, "window"_a = 0, "chunk"_a = 64, "o"_a, "o_bias"_a = nb::none(),
          "post_attn_norm"_a = nb::none(), "gate_up"_a, "mlp_norm"_a = nb::none(), "gate_up_bias"_a = nb::none(),
          "act"_a = "silu", "down"_a, "down_bias"_a = nb::none(), "post_mlp_norm"_a = nb::none())
      .def(
          "__call__",
          [](forkline::DecoderLayerCall& self, const mx::array& h, std::optional<mx::array> cos,
             std::optional<mx::array> sin, std::vector<mx::array> key_buffers, std::vector<mx::array> value_buffers,
             std::vector<std::tuple<int, int, int, int>> writes, const mx::array& q_pos,
             const std::vector<PartTuple>& parts, std::vector<std::tuple<int, int, int>> groups, bool panel) {
            return self(h, cos, sin, std::move(key_buffers), std::move(value_buffers), std::move(writes), q_pos,
                        attention_parts(parts), std::move(groups), panel);
          },
          "h"_a, "cos"_a.none(), "sin"_a.none(), "key_buffers"_a, "value_buffers"_a, "writes"_a, "q_pos"_a,
          "parts"_a, "groups"_a, "panel"_a = false);

  m.def("categorical", &forkline::categorical, "logits"_a, "uniforms"_a, nb::kw_only(), "inv_temperature"_a = 1.0f,
        "stream"_a = nb::none(),
        "one draw per row by the inverse cumulative distribution (see src/sample.h): logits float32 [R, V], "
        "uniforms float32 [R] in [0, 1) -> int32 [R]; p = e**((x - max) * inv_temperature)");
  m.def(
      "_categorical_row",
      [](const std::vector<float>& x, float inv_temperature, float u) {
        if (x.empty()) {
          throw std::invalid_argument("x must not be empty");
        }
        return forkline::categorical_row(x.data(), static_cast<int>(x.size()), inv_temperature, u);
      },
      "x"_a, "inv_temperature"_a, "u"_a, "one row's draw with the active ISA (for tests)");

  m.def("isa", [] { return std::string(forkline::isa_name(forkline::active_isa())); },
        "the instruction set the kernels use now: 'avx512', 'avx2' or 'scalar'");
  m.def("best_isa", [] { return std::string(forkline::isa_name(forkline::best_isa())); },
        "the best instruction set this CPU supports");
  m.def(
      "set_isa",
      [](const std::string& name) {
        forkline::Isa isa;
        if (!forkline::parse_isa(name.c_str(), isa)) {
          throw std::invalid_argument("isa must be 'avx512', 'avx2' or 'scalar', got '" + name + "'");
        }
        forkline::set_isa(isa);
        return std::string(forkline::isa_name(forkline::active_isa()));
      },
      "name"_a, "use 'scalar', 'avx2' or 'avx512' (at most best_isa()); returns the one in use");
  m.def("set_num_threads", &forkline::set_num_threads, "n"_a,
        "resize the worker pool (n < 1: FORKLINE_KERNEL_THREADS or all CPUs); not while kernels run");
  m.def("num_threads", &forkline::num_threads, "threads in the worker pool");
  m.def("_set_f32_tile", &forkline::set_f32_tile, "rows"_a, "cols"_a, "chunk"_a = 0,
        "spread"_a = -1,
        "force the float kernels' tile (1..6 rows x 1..4 weight rows; 0: built-in; spread -1 built-in, 0 adjacent "
        "weight rows, 1 spread at <= 2 rows); speed only, for tests");
  m.def(
      "pool_tuning",
      [] {
        const forkline::PoolTuning t = forkline::pool_tuning();
        nb::dict d;
        d["spin_us"] = t.spin_us;
        d["yield_"] = t.yield;
        d["wake_us"] = t.wake_us;
        d["parallel_us"] = t.parallel_us;
        return d;
      },
      "the worker pool's idle / wake policy (see src/pool.h)");
  m.def(
      "set_pool_tuning",
      [](std::optional<double> spin_us, std::optional<bool> yield_, std::optional<double> wake_us,
         std::optional<double> parallel_us) {
        forkline::PoolTuning t = forkline::pool_tuning();
        t.spin_us = spin_us.value_or(t.spin_us);
        t.yield = yield_.value_or(t.yield);
        t.wake_us = wake_us.value_or(t.wake_us);
        t.parallel_us = parallel_us.value_or(t.parallel_us);
        forkline::set_pool_tuning(t);
      },
      nb::kw_only(), "spin_us"_a = nb::none(), "yield_"_a = nb::none(), "wake_us"_a = nb::none(),
      "parallel_us"_a = nb::none(),
      "change the worker pool's policy (for benchmarks; values never depend on it)");
}
