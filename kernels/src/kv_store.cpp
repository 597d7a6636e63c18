#include "kv_store.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"

#include "common.h"

namespace forkline {

namespace {

[[noreturn]] void bad(const std::string& what) {
  throw std::invalid_argument("kv_store: " + what);
}

// The element at (a, b, c) of a 3-D array, by its strides (any layout), as bytes of `size`.
inline const char* at3(const mx::array& x, int64_t a, int64_t b, int64_t c, size_t size) {
  const auto& st = x.strides();
  return x.data<char>() + (a * st[0] + b * st[1] + c * st[2]) * static_cast<int64_t>(size);
}

// dst (row-contiguous [A, B, C]) = src (any strides).
void copy3(const mx::array& src, char* dst, size_t size) {
  const int64_t A = src.shape(0), B = src.shape(1), C = src.shape(2);
  if (src.flags().row_contiguous) {
    std::memcpy(dst, src.data<char>(), static_cast<size_t>(A * B * C) * size);
    return;
  }
  for (int64_t a = 0; a < A; ++a) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < C; ++c) {
        std::memcpy(dst + ((a * B + b) * C + c) * size, at3(src, a, b, c, size), size);
      }
    }
  }
}

}  // namespace

std::pair<std::vector<mx::array>, std::vector<mx::array>> kv_store(
    const mx::array& k, const mx::array& v, const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values, const std::vector<std::tuple<int, int, int, int>>& writes,
    mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    bad("CPU streams only");
  }
  if (k.ndim() != 3 || k.shape() != v.shape() || k.dtype() != v.dtype()) {
    bad("k and v must be [T, kv_heads, head_dim] of one dtype, got " + shape_str(k) + " / " + shape_str(v));
  }
  if (keys.empty() || keys.size() != values.size()) {
    bad("keys and values must be lists of one length >= 1");
  }
  const int t = k.shape(0), hkv = k.shape(1), d = k.shape(2);
  for (size_t i = 0; i < keys.size(); ++i) {
    const mx::array &kb = keys[i], &vb = values[i];
    if (kb.ndim() != 3 || kb.shape(0) != hkv || kb.shape(2) != d || kb.shape() != vb.shape()) {
      bad("buffers must be [" + std::to_string(hkv) + ", A, " + std::to_string(d) + "], got " + shape_str(kb) +
          " / " + shape_str(vb));
    }
    if (kb.dtype() != k.dtype() || vb.dtype() != k.dtype()) {
      bad("buffers must have k's dtype");
    }
  }
  for (size_t i = 0; i < keys.size(); ++i) {  // one output per buffer: a buffer listed twice would fork
    for (size_t j = 0; j < keys.size(); ++j) {
      if (keys[i].id() == values[j].id() || (i < j && (keys[i].id() == keys[j].id() || values[i].id() == values[j].id()))) {
        bad("every buffer must be a distinct array");
      }
    }
  }
  std::vector<int> spec;
  for (const auto& [buffer, src, dst, rows] : writes) {
    if (buffer < 0 || buffer >= static_cast<int>(keys.size()) || rows < 1 || src < 0 || src + rows > t ||
        dst < 0 || dst + rows > keys[buffer].shape(1)) {
      bad("write (" + std::to_string(buffer) + ", " + std::to_string(src) + ", " + std::to_string(dst) + ", " +
          std::to_string(rows) + ") is outside k's " + std::to_string(t) + " rows or its buffer");
    }
    spec.insert(spec.end(), {buffer, src, dst, rows});
  }
  std::vector<mx::array> inputs{k, v};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (const auto& group : {keys, values}) {
    for (const auto& b : group) {
      shapes.push_back(b.shape());
      dtypes.push_back(b.dtype());
    }
  }
  auto outs = mx::array::make_arrays(std::move(shapes), std::move(dtypes),
                                     std::make_shared<KVStore>(stream, std::move(spec)), std::move(inputs));
  const auto half = static_cast<std::ptrdiff_t>(keys.size());
  return {std::vector<mx::array>(outs.begin(), outs.begin() + half),
          std::vector<mx::array>(outs.begin() + half, outs.end())};
}

std::vector<bool> take_buffers(const std::vector<mx::array>& inputs, size_t first, std::vector<mx::array>& outputs,
                               size_t out_first) {
  // MLX gives every output of a multi-output op its own copy of the input list, so each input buffer
  // is referenced once per output and never looks donatable. The siblings' copies are only there for
  // graph traversal, which is over once the op runs (MLX detaches them after it): dropped here, the
  // buffers' reference counts say again whether anything else -- a view, a pending op, a Python name
  // -- still holds them.
  for (mx::array& out : outputs) {
    if (&out.inputs() != &inputs) {
      out.inputs().clear();
    }
  }
  // each output takes its input buffer over when MLX allows (the only reference, owned, dense),
  // else a copy of it
  std::vector<bool> copy(outputs.size() - out_first);
  for (size_t i = 0; i < copy.size(); ++i) {
    const mx::array& in = inputs[first + i];
    mx::array& out = outputs[out_first + i];
    if (in.is_donatable() && in.flags().row_contiguous) {
      out.copy_shared_buffer(in);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      copy[i] = true;
    }
  }
  return copy;
}

void kv_store_run(const mx::array& k, const mx::array& v, const std::vector<mx::array>& buffers,
                  std::vector<mx::array>& outputs, const std::vector<bool>& copy, const std::vector<int>& writes) {
  const size_t nbuf = outputs.size() / 2;
  const size_t size = k.itemsize();
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (copy[i]) {
      copy3(buffers[i], outputs[i].data<char>(), size);
    }
  }
  const int64_t hkv = k.shape(1), d = k.shape(2);
  const size_t row = static_cast<size_t>(d) * size;
  for (size_t w = 0; w + 3 < writes.size(); w += 4) {
    const int buffer = writes[w], src = writes[w + 1], dst = writes[w + 2], rows = writes[w + 3];
    for (int which = 0; which < 2; ++which) {  // keys, then values
      const mx::array& from = which == 0 ? k : v;
      mx::array& to = outputs[which * nbuf + buffer];
      const int64_t alloc = to.shape(1);
      char* base = to.data<char>();
      const bool dense = from.flags().row_contiguous;
      for (int r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < hkv; ++h) {
          char* out = base + ((h * alloc + dst + r) * d) * static_cast<int64_t>(size);
          if (dense) {
            std::memcpy(out, from.data<char>() + (((src + r) * hkv + h) * d) * static_cast<int64_t>(size), row);
          } else {
            for (int64_t c = 0; c < d; ++c) {
              std::memcpy(out + c * static_cast<int64_t>(size), at3(from, src + r, h, c, size), size);
            }
          }
        }
      }
    }
  }
}

void KVStore::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  std::vector<bool> copy = take_buffers(inputs, 2, outputs, 0);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  // The task holds its own references to the arrays until it has run.
  encoder.dispatch([inputs, outputs, copy, writes = writes_]() mutable {
    const std::vector<mx::array> buffers(inputs.begin() + 2, inputs.end());
    kv_store_run(inputs[0], inputs[1], buffers, outputs, copy, writes);
  });
}

void KVStore::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("ForklineKVStore has no GPU implementation");
}

std::vector<mx::Shape> KVStore::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> out;
  for (size_t i = 2; i < inputs.size(); ++i) {
    out.push_back(inputs[i].shape());
  }
  return out;
}

bool KVStore::is_equivalent(const mx::Primitive& other) const {
  return writes_ == static_cast<const KVStore&>(other).writes_;
}

}  // namespace forkline
