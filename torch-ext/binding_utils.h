// Helpers shared by every op binding: the checks of what is torch's (devices, dtypes, shapes and
// strides of tensors), with messages that name the op and the argument, ltx_rows_t views of
// tensors, and the one path every op runs: the launcher's argument check (kernel_src/checks.h),
// turned into a message naming the argument, then the CUDA launcher or its C twin.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdio>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(CUDA_KERNEL)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include "../kernel_src/checks.h"
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
// A dtype by torch's name ("float32", "bfloat16", "int8"), as users write it, not c10's ("Float",
// "BFloat16", "Char"): every message naming a dtype goes through here.
inline std::string text(c10::ScalarType t) { return std::string(c10::getDtypeNames(t).first); }
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
#define LTX_CHECK(cond, ...)                               \
  do {                                                     \
    if (C10_UNLIKELY(!(cond))) {                           \
      TORCH_CHECK(false, ::ltx_binding::cat(__VA_ARGS__)); \
    }                                                      \
  } while (0)

inline ltx_dtype_t to_ltx_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return LTX_FLOAT32;
    case at::kHalf: return LTX_FLOAT16;
    case at::kBFloat16: return LTX_BFLOAT16;
    case at::kDouble: return LTX_FLOAT64;
    case at::kFloat8_e4m3fn: return LTX_FLOAT8_E4M3;  // (quantized outputs only)
    case at::kChar: return LTX_INT8;                  // (quantized outputs, attention codes)
    case at::kInt: return LTX_INT32;                  // (index vectors only)
    case at::kLong: return LTX_INT64;
    default: LTX_CHECK(false, "unsupported dtype ", type);  // callers check first
  }
  return LTX_FLOAT32;  // unreachable
}

inline at::ScalarType to_scalar_type(ltx_dtype_t dtype) {
  switch (dtype) {
    case LTX_FLOAT16: return at::kHalf;
    case LTX_BFLOAT16: return at::kBFloat16;
    case LTX_FLOAT64: return at::kDouble;
    case LTX_FLOAT8_E4M3: return at::kFloat8_e4m3fn;
    case LTX_INT8: return at::kChar;
    case LTX_INT32: return at::kInt;
    case LTX_INT64: return at::kLong;
    default: return at::kFloat;
  }
}

inline bool is_supported_float(at::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// An activation [..., hidden]: float32/float16/bfloat16 (with cpu_float64, also float64 on the
// CPU: ops whose C twin computes in double, for gradcheck), at least 1-D, last dim contiguous.
// t is float32, float16 or bfloat16 (with cpu_float64, also float64 on the CPU: ops whose C twin
// computes in double, for gradcheck).
inline void check_float(const char* op, const char* name, const at::Tensor& t, bool cpu_float64) {
  const bool float64 = cpu_float64 && t.scalar_type() == at::kDouble;
  LTX_CHECK(!float64 || t.is_cpu(), op, ": ", name,
            " is float64, which only the CPU backend takes (for gradcheck); on ", t.device(),
            " use float32, float16 or bfloat16");
  LTX_CHECK(
      float64 || is_supported_float(t.scalar_type()), op, ": ", name, " must be ",
      cpu_float64 ? "float32, float16, bfloat16 or (CPU) float64" : "float32, float16 or bfloat16",
      ", got ", t.scalar_type());
}

// A float64 activation: the ops whose C twin takes it (cpu_float64 above) take float64 operands
// (weights, modulation, tables) only with it (their launcher rules say which).
inline bool is_float64(const at::Tensor& x) { return x.scalar_type() == at::kDouble; }

inline void check_activation(const char* op, const char* name, const at::Tensor& t,
                             bool cpu_float64 = false) {
  LTX_CHECK(t.dim() >= 1, op, ": ", name, " must have at least 1 dimension, got a 0-d tensor");
  check_float(op, name, t, cpu_float64);
  LTX_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0, op, ": ", name,
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
                                 int64_t hidden, const at::Tensor& x, bool cpu_float64 = false) {
  check_same_device(op, name, t, "x", x);
  check_float(op, name, t, cpu_float64);
  LTX_CHECK(t.dim() == 1 && t.size(0) == hidden, op, ": ", name, " must have shape [hidden] = [",
            hidden, "] (x.shape[-1]), got ", t.sizes());
  LTX_CHECK(t.stride(0) == 1 || hidden <= 1, op, ": ", name, " must be contiguous, got stride ",
            t.stride(0));
}

// The address of a present operand for the launchers: t's data, and not NULL (which means absent)
// even when t is empty.
inline void* present_data(const at::Tensor& t) {
  static char empty_tensor;
  return t.data_ptr() ? const_cast<void*>(t.data_ptr()) : &empty_tensor;
}

// A quantized output of x's shape (ltx_kernels.h, Quantized outputs) in `format`, the str format of
// the quantized ops ("e4m3_row", "i8_row"): its codes, its scales (x.shape[:-1] fp32, one per row;
// rows with no elements get the scale of an amax of 0) and the descriptor the launchers take.
struct QuantOutput {
  at::Tensor codes, scale;
  ltx_quant_t quant;
};

inline QuantOutput quant_output(const char* op, const at::Tensor& x, c10::string_view format) {
  LTX_CHECK(format == "e4m3_row" || format == "i8_row", op,
            ": format must be 'e4m3_row' or 'i8_row', got '", std::string(format), "'");
  const bool i8 = format == "i8_row";
  QuantOutput out;
  out.codes = at::empty(x.sizes(), x.options().dtype(i8 ? at::kChar : at::kFloat8_e4m3fn));
  out.scale = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  if (x.size(-1) == 0) {
    float empty_row_scale;
    ltx_row_factor(0.f, i8 ? LTX_I8_MAX : LTX_E4M3_MAX, &empty_row_scale);
    out.scale.fill_(empty_row_scale);
  }
  out.quant = ltx_quant_t{i8 ? LTX_QUANT_I8_ROW : LTX_QUANT_E4M3_ROW,
                          static_cast<float*>(present_data(out.scale)), 0};
  return out;
}

// The rows of t (all dims but the last) as (size, stride) levels, outermost first: size-1 dims
// are dropped and dims that step evenly into each other are merged, so any view whose rows are
// evenly spaced, and [B, S, D]-style views with arbitrary strides, are one to three levels.
using RowLevels = std::vector<std::pair<int64_t, int64_t>>;

inline RowLevels row_levels(const at::Tensor& t) {
  RowLevels levels;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size == 1) continue;
    if (!levels.empty() && levels.back().second == stride * size)
      levels.back() = {levels.back().first * size, stride};
    else
      levels.emplace_back(size, stride);
  }
  return levels;
}

// Whether the launchers' ltx_rows_t describes t's rows in place (at most LTX_MAX_ROW_DIMS levels;
// an empty tensor is zero rows).
inline bool rows_fit(const at::Tensor& t) {
  return t.numel() == 0 || row_levels(t).size() <= LTX_MAX_ROW_DIMS;
}

// The rows of t for the launchers, no copy: row_levels padded to LTX_MAX_ROW_DIMS. An empty tensor
// is zero rows at a non-NULL address (present, but nothing is read or written). Rows spread over
// more levels raise an error naming the op and the argument.
inline ltx_rows_t rows_of(const char* op, const char* name, const at::Tensor& t) {
  if (t.numel() == 0) {
    ltx_rows_t rows{};
    rows.data = present_data(t);
    rows.dtype = to_ltx_dtype(t.scalar_type());
    rows.size[0] = 0;
    rows.size[1] = rows.size[2] = 1;
    return rows;
  }
  const RowLevels levels = row_levels(t);
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

// t itself when rows_of describes its rows, else one contiguous copy of it (the caller keeps the
// result alive through the launch). For what the op reads but the caller does not lay out: a
// broadcast operand expanded to x's rows (a [B, 1, H, 1, C] scale of a [B, F, H, W, C] x has four
// levels), an incoming gradient (autograd hands over expanded ones).
inline at::Tensor fitting_rows(const at::Tensor& t) { return rows_fit(t) ? t : t.contiguous(); }

// The copies fitting_rows made for the ltx_rows_t of one launch, held until it is enqueued (on
// CUDA the caching allocator reuses a freed block only after the work queued on its stream).
using Held = std::vector<at::Tensor>;

// The rows of an operand the op reads (see fitting_rows): in place, or of its copy, kept in held.
inline ltx_rows_t operand_rows(const char* op, const char* name, const at::Tensor& t, Held& held) {
  if (rows_fit(t)) return rows_of(op, name, t);
  held.push_back(t.contiguous());
  return rows_of(op, name, held.back());
}

// An absent optional row operand (data NULL).
inline ltx_rows_t no_rows() {
  ltx_rows_t rows{};
  rows.data = nullptr;
  rows.dtype = LTX_FLOAT32;
  return rows;
}

// A second activation of exactly x's shape (y of a residual; its dtype is a launcher rule).
inline void check_like_x(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x,
                         bool cpu_float64 = false, const char* x_name = "x") {
  check_same_device(op, name, t, x_name, x);
  check_activation(op, name, t, cpu_float64);
  LTX_CHECK(t.sizes() == x.sizes(), op, ": ", name, " must have ", x_name, "'s shape ", x.sizes(),
            ", got ", t.sizes());
}

// A per-row operand that broadcasts to `shape` (x's shape, or x's leading dims + [last]): a
// contiguous last dim of exactly shape.back() elements, leading dims of size 1 or equal. It is
// expanded (stride-0 dims, no copy) and returned; operand_rows then describes one row per x row.
inline at::Tensor broadcast_operand(const char* op, const char* name, const at::Tensor& t,
                                    const at::Tensor& x, c10::IntArrayRef shape,
                                    bool cpu_float64 = false) {
  check_same_device(op, name, t, "x", x);
  check_float(op, name, t, cpu_float64);
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

// An optional per-channel vector of `length` elements (data NULL when absent); its dtype rules are
// the launcher's.
inline ltx_vector_t optional_vector(const char* op, const char* name,
                                    const std::optional<at::Tensor>& t, const at::Tensor& x,
                                    int64_t length, bool cpu_float64 = false) {
  if (!t) return ltx_vector_t{nullptr, LTX_FLOAT32};
  check_channel_vector(op, name, *t, length, x, cpu_float64);
  return ltx_vector_t{present_data(*t), to_ltx_dtype(t->scalar_type())};
}

// ------------------------------------------------------------------------------------------------
// The one path of every op: argument check, then the CUDA launcher or its C twin.
// ------------------------------------------------------------------------------------------------
// Launcher argument names (ltx_kernels.h) -> the op's argument names, where they differ.
using ArgNames = std::initializer_list<std::pair<std::string_view, const char*>>;

inline std::string op_arg_name(const char* launcher_name, ArgNames names) {
  if (!launcher_name) return "argument";
  for (const auto& [from, to] : names)
    if (from == launcher_name) return to;
  return launcher_name;
}

// The error message of a failed launcher argument check, naming the op's argument and the rule.
inline std::string check_message(const char* op, const ltx_check_t& c, ArgNames names) {
  const std::string arg = op_arg_name(c.arg, names), ref = op_arg_name(c.ref, names);
  const at::ScalarType dtype = to_scalar_type(c.arg_dtype), ref_dtype = to_scalar_type(c.ref_dtype);
  switch (c.rule) {
    case LTX_RULE_ROW_COUNT: return cat(op, ": ", arg, " must have as many rows as ", ref);
    case LTX_RULE_REQUIRES: return cat(op, ": ", arg, " is only allowed with ", ref);
    case LTX_RULE_FLOAT_DTYPE: return cat(op, ": ", arg, " must be float32, float16 or bfloat16");
    case LTX_RULE_FLOAT_OR_FLOAT64_DTYPE:
      return cat(op, ": ", arg, " must be float32, float16, bfloat16 or float64");
    case LTX_RULE_DTYPE_OF:
      return cat(op, ": ", arg, " must have ", ref, "'s dtype ", ref_dtype, ", got ", dtype);
    case LTX_RULE_MODEL_DTYPE:
      return cat(op, ": ", arg, " must have ", ref, "'s dtype ", ref_dtype,
                 " (pass upcast=True to compute in float32 with a float32 ", arg, "), got ", dtype);
    case LTX_RULE_DTYPE_OF_OR_FLOAT32:
      return cat(op, ": ", arg, " must be ", ref_dtype, " or float32, got ", dtype);
    case LTX_RULE_SAME_DTYPE_AS:
      return cat(op, ": ", arg, " must have the dtype of ", ref, " (", ref_dtype, "), got ", dtype);
    case LTX_RULE_EPS: return cat(op, ": eps must be finite and >= 0, got ", c.value);
    case LTX_RULE_EVEN_HEAD_DIM:
      return cat(op, ": rotation needs an even last dimension, got ", c.value);
    case LTX_RULE_ROT_DIM:
      return cat(op, ": ", arg, " must have last dimension ", c.expected, ", got ", c.value);
    case LTX_RULE_ROT_DIM_OR_HALF:
      return cat(op, ": ", arg, " must have last dimension ", c.expected, " or ", c.expected / 2,
                 " (both halves share it), got ", c.value);
    case LTX_RULE_INDEX_DTYPE: return cat(op, ": ", arg, " must be int32 or int64, got ", dtype);
    case LTX_RULE_SHAPE_OF: return cat(op, ": ", arg, "'s shape does not agree with ", ref, "'s");
    case LTX_RULE_FINITE: return cat(op, ": ", arg, " must be finite, got ", c.value);
    case LTX_RULE_CODE_DTYPE: return cat(op, ": ", arg, " must be ", ref_dtype, ", got ", dtype);
    default: return cat(op, ": invalid launcher argument ", arg);
  }
}

// Raises the error of a launcher argument check that failed.
inline void check_launcher_args(const char* op, const ltx_check_t& check, ArgNames names = {}) {
  LTX_CHECK(check.status == LTX_OK, check_message(op, check, names));
}

// The message of a launcher status other than LTX_OK.
inline std::string launcher_error(int status) {
  switch (status) {
    case LTX_ERR_INVALID_ARGUMENT: return "invalid argument (LTX_ERR_INVALID_ARGUMENT)";
    case LTX_ERR_UNSUPPORTED_DTYPE: return "unsupported dtype (LTX_ERR_UNSUPPORTED_DTYPE)";
  }
#if defined(CUDA_KERNEL)
  if (status > 0) return cudaGetErrorString(static_cast<cudaError_t>(status));
#endif
  return "status " + std::to_string(status);
}

inline void check_status(const char* op, int status) {
  LTX_CHECK(status == LTX_OK, op, ": kernel failed: ", launcher_error(status));
}

// Split [0, rows) into chunks of at least `min_elements` elements for at::parallel_for.
inline int64_t cpu_grain(int64_t hidden, int64_t min_elements = 1 << 15) {
  return std::max<int64_t>(1, min_elements / std::max<int64_t>(hidden, 1));
}

// Runs one op on both backends. `check` is the launcher's argument check (ltx_check_*): a failure
// raises an error naming the argument (launcher names mapped to the op's by `names`). Then, unless
// the `rows` rows of `hidden` elements are empty, runs cuda(stream) on the current stream of x's
// device under a device guard, or cpu(row_begin, row_end), the C twin, over the rows on the
// intra-op thread pool.
template <typename Cuda, typename Cpu>
void run_launcher(const char* op, const ltx_check_t& check, const at::Tensor& x, int64_t rows,
                  int64_t hidden, const Cuda& cuda, const Cpu& cpu, ArgNames names = {}) {
  check_launcher_args(op, check, names);
  if (rows == 0 || hidden == 0) return;
  if (x.is_cuda()) {
#if defined(CUDA_KERNEL)
    const c10::cuda::OptionalCUDAGuard device_guard(x.device());
    check_status(op, cuda(at::cuda::getCurrentCUDAStream().stream()));
    return;
#else
    LTX_CHECK(false, op, ": this build has no CUDA kernels");
#endif
  }
  std::atomic<int> status{LTX_OK};
  at::parallel_for(0, rows, cpu_grain(hidden), [&](int64_t begin, int64_t end) {
    const int s = cpu(begin, end);
    if (s != LTX_OK) status.store(s);
  });
  check_status(op, status.load());
}

}  // namespace ltx_binding
