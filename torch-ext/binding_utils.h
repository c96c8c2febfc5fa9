// Helpers shared by every op binding: argument checks whose messages name the op and the argument,
// dtype mapping, ltx_rows_t views of tensors, and launcher status handling.
#pragma once

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "../kernel_src/ltx_kernels.h"

namespace ltx_binding {

// Error messages are assembled as one std::string, with numbers formatted by std::to_string and
// snprintf: no iostreams. (Streaming integers through std::ostream from inside the extension
// crashed with the GPU machine's toolchain, gcc 13 + torch 2.11, in c10::str.)
inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
inline std::string text(int64_t v) { return std::to_string(v); }
inline std::string text(int v) { return std::to_string(v); }
inline std::string text(size_t v) { return std::to_string(v); }
inline std::string text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
inline std::string text(c10::ScalarType t) { return c10::toString(t); }
inline std::string text(const c10::Device& d) { return d.str(); }
inline std::string text(c10::IntArrayRef dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
  return out + "]";
}

template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::string out;
  ((out += text(parts)), ...);
  return out;
}

// TORCH_CHECK whose message (built only on failure) is cat(parts...).
#define LTX_CHECK(cond, ...)                                            \
  do {                                                                  \
    if (C10_UNLIKELY(!(cond))) {                                        \
      TORCH_CHECK(false, ::ltx_binding::cat(__VA_ARGS__));              \
    }                                                                   \
  } while (0)

inline ltx_dtype_t to_ltx_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return LTX_FLOAT32;
    case at::kHalf: return LTX_FLOAT16;
    case at::kBFloat16: return LTX_BFLOAT16;
    default: LTX_CHECK(false, "unsupported dtype ", type);  // callers check first
  }
  return LTX_FLOAT32;  // unreachable
}

inline bool is_supported_float(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// An activation [..., hidden]: float32/float16/bfloat16, at least 1-D, last dim contiguous.
inline void check_activation(const char* op, const char* name, const at::Tensor& t) {
  LTX_CHECK(t.dim() >= 1, op, ": ", name, " must have at least 1 dimension, got a 0-d tensor");
  LTX_CHECK(is_supported_float(t.scalar_type()), op, ": ", name,
              " must be float32, float16 or bfloat16, got ", t.scalar_type());
  LTX_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, op, ": ", name,
              " must have a contiguous last dimension (stride 1), got strides ", t.strides(),
              " for shape ", t.sizes());
}

// Every tensor of an op lives on the device of its first activation.
inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const char* ref_name, const at::Tensor& ref) {
  LTX_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; all tensors must be on the same device");
}

// A per-channel parameter: 1-D with `hidden` contiguous float elements on x's device.
inline void check_channel_vector(const char* op, const char* name, const at::Tensor& t,
                                 int64_t hidden, const at::Tensor& x) {
  check_same_device(op, name, t, "x", x);
  LTX_CHECK(is_supported_float(t.scalar_type()), op, ": ", name,
              " must be float32, float16 or bfloat16, got ", t.scalar_type());
  LTX_CHECK(t.dim() == 1 && t.size(0) == hidden, op, ": ", name,
              " must have shape [hidden] = [", hidden, "] (x.shape[-1]), got ", t.sizes());
  LTX_CHECK(t.stride(0) == 1 || hidden <= 1, op, ": ", name,
              " must be contiguous, got stride ", t.stride(0));
}

inline void check_eps(const char* op, double eps) {
  LTX_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
}

// The rows of t (all dims but the last) as at most LTX_MAX_ROW_DIMS (size, stride) levels:
// size-1 dims are dropped and dims that step evenly into each other are merged, so any view whose
// rows are evenly spaced, and [B, S, D]-style views with arbitrary strides, need no copy.
inline ltx_rows_t rows_of(const char* op, const char* name, const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> levels;  // (size, stride), outermost first
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size == 1) continue;
    if (!levels.empty() && levels.back().second == stride * size)
      levels.back() = {levels.back().first * size, stride};
    else
      levels.emplace_back(size, stride);
  }
  LTX_CHECK(levels.size() <= LTX_MAX_ROW_DIMS, op, ": ", name, " with shape ", t.sizes(),
              " and strides ", t.strides(), " has rows spread over more than ", LTX_MAX_ROW_DIMS,
              " unmergeable dimensions; pass ", name, ".contiguous() instead");
  ltx_rows_t rows;
  rows.data = const_cast<void*>(t.data_ptr());
  rows.dtype = to_ltx_dtype(t.scalar_type());
  const size_t pad = LTX_MAX_ROW_DIMS - levels.size();
  for (size_t d = 0; d < LTX_MAX_ROW_DIMS; ++d) {
    rows.size[d] = d < pad ? 1 : levels[d - pad].first;
    rows.stride[d] = d < pad ? 0 : levels[d - pad].second;
  }
  return rows;
}

// An absent optional row operand (data NULL).
inline ltx_rows_t no_rows() {
  ltx_rows_t rows{};
  rows.data = nullptr;
  rows.dtype = LTX_FLOAT32;
  return rows;
}

// Operand dtype under the rounding rules of the fused ops (ltx_kernels.h): x's dtype, or with
// upcast also float32.
inline void check_operand_dtype(const char* op, const char* name, const at::Tensor& t,
                                const at::Tensor& x, bool upcast) {
  LTX_CHECK(is_supported_float(t.scalar_type()), op, ": ", name,
            " must be float32, float16 or bfloat16, got ", t.scalar_type());
  if (upcast) {
    LTX_CHECK(t.scalar_type() == x.scalar_type() || t.scalar_type() == at::kFloat, op, ": ", name,
              " must be ", x.scalar_type(), " or float32, got ", t.scalar_type());
  } else {
    LTX_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ",
              x.scalar_type(), " (pass upcast=True to compute in float32 with a float32 ", name,
              "), got ", t.scalar_type());
  }
}

// A second activation of exactly x's shape and dtype (y of a residual).
inline void check_like_x(const char* op, const char* name, const at::Tensor& t,
                         const at::Tensor& x) {
  check_same_device(op, name, t, "x", x);
  check_activation(op, name, t);
  LTX_CHECK(t.sizes() == x.sizes(), op, ": ", name, " must have x's shape ", x.sizes(), ", got ",
            t.sizes());
  LTX_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ",
            x.scalar_type(), ", got ", t.scalar_type());
}

// A per-row operand that broadcasts to `shape` (x's shape, or x's leading dims + [last]): a
// contiguous last dim of exactly shape.back() elements, leading dims of size 1 or equal. It is
// expanded (stride-0 dims, no copy) and returned; rows_of then describes one row per x row.
inline at::Tensor broadcast_operand(const char* op, const char* name, const at::Tensor& t,
                                    const at::Tensor& x, c10::IntArrayRef shape) {
  check_same_device(op, name, t, "x", x);
  LTX_CHECK(is_supported_float(t.scalar_type()), op, ": ", name,
            " must be float32, float16 or bfloat16, got ", t.scalar_type());
  LTX_CHECK(t.dim() >= 1 && t.size(-1) == shape.back(), op, ": ", name,
            " must have last dimension ", shape.back(), ", got shape ", t.sizes());
  LTX_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, op, ": ", name,
            " must have a contiguous last dimension (stride 1), got strides ", t.strides());
  bool broadcasts = t.dim() <= static_cast<int64_t>(shape.size());
  for (int64_t i = 1; broadcasts && i < t.dim(); ++i) {
    const int64_t size = t.size(-1 - i), target = shape[shape.size() - 1 - i];
    broadcasts = size == 1 || size == target;
  }
  LTX_CHECK(broadcasts, op, ": ", name, " with shape ", t.sizes(),
            " does not broadcast to x's shape ", shape);
  return t.expand(shape);
}

inline const void* optional_data(const std::optional<at::Tensor>& t) {
  return t ? t->data_ptr() : nullptr;
}

inline ltx_dtype_t optional_dtype(const std::optional<at::Tensor>& t) {
  return t ? to_ltx_dtype(t->scalar_type()) : LTX_FLOAT32;
}

std::string launcher_error(int status);  // defined in torch_binding.cpp

inline void check_status(const char* op, int status) {
  LTX_CHECK(status == LTX_OK, op, ": kernel failed: ", launcher_error(status));
}

// Split [0, rows) into chunks of at least `min_elements` elements for at::parallel_for.
inline int64_t cpu_grain(int64_t hidden, int64_t min_elements = 1 << 15) {
  return std::max<int64_t>(1, min_elements / std::max<int64_t>(hidden, 1));
}

}  // namespace ltx_binding
