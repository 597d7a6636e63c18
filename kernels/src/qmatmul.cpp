#include "qmatmul.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"

#include "common.h"
#include "gemm.h"
#include "pool.h"
#include "qdot.h"

namespace forkline {

namespace {

// Below this many activation elements one thread quantizes them (a pool round trip costs more).
constexpr int64_t kParallelQuantize = 1 << 14;

// One thread's speed, for the pool's policy (measured on the 2-core EPYC of DESIGN.md section 8, at
// the SmolLM2 shapes): weight bytes per microsecond at one row, multiply-adds per microsecond at many.
constexpr double kBytesPerUs = 9000.0;
constexpr double kMacsPerUs = 20000.0;
// A task's target length: long enough that claiming it (an atomic add) is noise, short enough that
// the caller rarely waits long at the end for a worker's last task.
constexpr double kTaskUs = 6.0;

struct Split {
  int cols;  // output columns per task (a multiple of 16)
  double est_us;  // the whole call on one thread
};

Split plan_split(Format format, int m, int n, int blocks) {
  const double per_weight = format == Format::q8_0 ? 1.125 : 0.75;
  const double weights = static_cast<double>(n) * blocks * 32;
  const double est = std::max(weights * per_weight / kBytesPerUs, weights * m / kMacsPerUs);
  const int tasks = static_cast<int>(std::max(1.0, std::min(est / kTaskUs, n / 16.0)));
  const int cols = ((n + tasks - 1) / tasks + 15) / 16 * 16;
  return {cols, est};
}

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument(what);
}

mx::array make_op(Format format, const char* op, const mx::array& x, std::vector<mx::array> weights,
                  bool quantize_x, bool panel, mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    bad(std::string(op) + ": CPU streams only (on a GPU use mlx.core.quantized_matmul)");
  }
  const mx::array& wq = weights[0];
  if (wq.ndim() != 2) {
    bad(std::string(op) + ": weights must be 2-D, got " + shape_str(wq));
  }
  const int n = wq.shape(0);
  const int packed = format == Format::q8_0 ? 32 : 16;  // bytes per 32 weights
  const mx::Dtype wtype = format == Format::q8_0 ? mx::int8 : mx::uint8;
  if (wq.dtype() != wtype || wq.shape(1) % packed != 0) {
    bad(std::string(op) + ": weights must be " + (format == Format::q8_0 ? "int8" : "uint8") +
        " with a multiple of " + std::to_string(packed) + " columns, got " + shape_str(wq));
  }
  const int blocks = wq.shape(1) / packed;
  for (size_t i = 1; i < weights.size(); ++i) {
    if (weights[i].dtype() != mx::float32 || weights[i].ndim() != 2 || weights[i].shape(0) != n ||
        weights[i].shape(1) != blocks) {
      bad(std::string(op) + ": scales must be float32 [" + std::to_string(n) + ", " +
          std::to_string(blocks) + "], got " + shape_str(weights[i]));
    }
  }
  if (x.ndim() < 1) {
    bad(std::string(op) + ": x must have at least one dimension");
  }
  const int k = x.shape(-1);
  if (k > blocks * 32 || k <= blocks * 32 - 32) {
    bad(std::string(op) + ": x has " + std::to_string(k) + " columns, the weights " +
        std::to_string(blocks * 32) + " (padded to a multiple of 32)");
  }
  if (!mx::issubdtype(x.dtype(), mx::floating)) {
    bad(std::string(op) + ": x must be a floating-point array");
  }
  mx::array x32 = x.dtype() == mx::float32 ? x : mx::astype(x, mx::float32, stream);
  mx::Shape lead(x.shape().begin(), x.shape().end() - 1);
  if (x32.ndim() != 2) {
    x32 = mx::reshape(x32, {-1, k}, stream);
  }
  std::vector<mx::array> inputs{x32};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  mx::array out(
      {x32.shape(0), n}, mx::float32, std::make_shared<QuantizedMatmul>(stream, format, k, quantize_x && !panel, panel), std::move(inputs));
  if (lead.size() != 1) {
    lead.push_back(n);
    out = mx::reshape(out, lead, stream);
  }
  return out;
}

}  // namespace

void float_rows_matmul(Format format, const float* x, int m, int blocks, int n, const void* wq,
                       const float* scales, const float* mins, float* y, int64_t ldy) {
  if (m == 0 || n == 0) {
    return;
  }
  const Isa isa = active_isa();
  thread_local LineVector<float> aligned;  // the caller's (workers read through x)
  x = line_aligned(x, static_cast<size_t>(m) * blocks * 32, aligned);
  const Split split = plan_split(format, m, n, blocks);
  const int cols = split.cols;
  pool().run_estimated((n + cols - 1) / cols, split.est_us, [&](int task) {
    const int n0 = task * cols, n1 = std::min(n, n0 + cols);
    if (format == Format::q8_0) {
      q8_0_rows_f32(isa, static_cast<const int8_t*>(wq), scales, blocks, n0, n1, x, m, y, ldy);
    } else {
      q4_1_rows_f32(isa, static_cast<const uint8_t*>(wq), scales, mins, blocks, n0, n1, x, m, y, ldy);
    }
  });
}

mx::array q8_0_matmul(const mx::array& x, const mx::array& wq, const mx::array& scales, bool quantize_x,
                      bool panel, mx::StreamOrDevice s) {
  return make_op(Format::q8_0, "q8_0_matmul", x, {wq, scales}, quantize_x, panel, s);
}

mx::array q4_1_matmul(const mx::array& x, const mx::array& wq, const mx::array& scales, const mx::array& mins,
                      bool quantize_x, bool panel, mx::StreamOrDevice s) {
  return make_op(Format::q4_1, "q4_1_matmul", x, {wq, scales, mins}, quantize_x, panel, s);
}

void QuantizedMatmul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  for (size_t i = 1; i < inputs.size(); ++i) {
    if (!inputs[i].flags().row_contiguous) {
      bad(std::string(name()) + ": quantized weights must be row-contiguous");
    }
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // The task holds its own references to the arrays until it has run.
  encoder.dispatch([inputs, out, format = format_, k = k_, quantize_x = quantize_x_, panel = panel_]() mutable {
    const mx::array& x = inputs[0];
    const int m = x.shape(0);
    const int n = out.shape(1);
    const int blocks = inputs[2].shape(1);
    if (m == 0 || n == 0) {
      return;
    }
    const Isa isa = active_isa();
    WorkerPool& workers = pool();
    float* y = out.data<float>();
    const float* xp = x.data<float>();
    const int64_t rs = x.strides()[0], cs = x.strides()[1];
    // Per-thread scratch for prepared activations, reused across calls.
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> d, s;
    thread_local LineVector<float> xf;
    const size_t padded = static_cast<size_t>(m) * blocks * 32;
    if (!quantize_x) {  // float activations: dense, zero-padded rows (copied where x is not)
      const float* xrows = xp;
      if (!(cs == 1 && (rs == k || m == 1) && k == blocks * 32)) {
        xf.resize(padded);
        for (int64_t r = 0; r < m; ++r) {
          float* dst = xf.data() + r * blocks * 32;
          for (int64_t i = 0; i < k; ++i) {
            dst[i] = xp[r * rs + i * cs];
          }
          std::fill(dst + k, dst + blocks * 32, 0.0f);
        }
        xrows = xf.data();
      }
      const float* mins = format == Format::q4_1 ? inputs[3].data<float>() : nullptr;
      if (panel) {
        panel_matmul(isa, format, xrows, m, blocks, n, inputs[1].data<void>(), inputs[2].data<float>(), mins, y, n);
      } else {
        float_rows_matmul(format, xrows, m, blocks, n, inputs[1].data<void>(), inputs[2].data<float>(), mins, y, n);
      }
      return;
    }
    // int8 activations: their blocks, scales and scaled sums
    q.resize(padded);
    d.resize(static_cast<size_t>(m) * blocks);
    s.resize(static_cast<size_t>(m) * blocks);
    const QuantizedRows rows{q.data(), d.data(), s.data()};
    if (static_cast<int64_t>(m) * k < kParallelQuantize || workers.size() == 1) {
      quantize_rows(isa, xp, rs, cs, k, blocks, 0, m, rows);
    } else {
      workers.run(m, [&](int r) { quantize_rows(isa, xp, rs, cs, k, blocks, r, r + 1, rows); });
    }
    // Output columns in runs of `cols` (tasks shared by the pool); the split never changes a value.
    // (The workers must not name the thread_local scratch: they would see their own, empty, copies.)
    const Split split = plan_split(format, m, n, blocks);
    const int cols = split.cols;
    auto columns = [&](int task) {
      const int n0 = task * cols, n1 = std::min(n, n0 + cols);
      const float* sc = inputs[2].data<float>();
      if (format == Format::q8_0) {
        q8_0_rows(isa, inputs[1].data<int8_t>(), sc, blocks, n0, n1, rows, m, y, n);
      } else {
        q4_1_rows(isa, inputs[1].data<uint8_t>(), sc, inputs[3].data<float>(), blocks, n0, n1, rows, m, y, n);
      }
    };
    workers.run_estimated((n + cols - 1) / cols, split.est_us, columns);
  });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string(name()) + " has no GPU implementation; use mlx.core.quantized_matmul");
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[1].shape(0)}};
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantizedMatmul&>(other);
  return format_ == o.format_ && k_ == o.k_ && quantize_x_ == o.quantize_x_ && panel_ == o.panel_;
}

}  // namespace forkline
