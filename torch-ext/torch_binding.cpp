// The ltx_kernels op library: one schema per op, with CPU and CUDA implementations that check
// their arguments, allocate the outputs, and call the C launchers on the current stream.
#include "torch_binding.h"

#include <atomic>

#include <ATen/Parallel.h>

#if defined(CUDA_KERNEL)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

#include "binding_utils.h"
#include "ltx_registration.h"

// kernel-builder gives the op namespace the (versioned) extension name; the setuptools build
// names it `ltx_kernels`.
#ifndef LTX_OPS_NAMESPACE
#define LTX_OPS_NAMESPACE TORCH_EXTENSION_NAME
#endif

namespace ltx_binding {

std::string launcher_error(int status) {
  switch (status) {
    case LTX_ERR_INVALID_ARGUMENT: return "invalid argument (LTX_ERR_INVALID_ARGUMENT)";
    case LTX_ERR_UNSUPPORTED_DTYPE: return "unsupported dtype (LTX_ERR_UNSUPPORTED_DTYPE)";
  }
#if defined(CUDA_KERNEL)
  if (status > 0) return cudaGetErrorString(static_cast<cudaError_t>(status));
#endif
  return "status " + std::to_string(status);
}

// Runs fn(row_begin, row_end) -> status over [0, rows) on the intra-op thread pool.
template <typename Fn>
int parallel_rows(int64_t rows, int64_t hidden, const Fn& fn) {
  std::atomic<int> status{LTX_OK};
  at::parallel_for(0, rows, cpu_grain(hidden), [&](int64_t begin, int64_t end) {
    const int s = fn(begin, end);
    if (s != LTX_OK) status.store(s);
  });
  return status.load();
}

}  // namespace ltx_binding

using namespace ltx_binding;

// ------------------------------------------------------------------------------------------------
// rmsnorm
// ------------------------------------------------------------------------------------------------
static constexpr const char* kRmsNorm = "ltx_kernels.rmsnorm";

// Checks and output allocation shared by both backends. The output is contiguous, of x's shape,
// and of weight's dtype when there is a weight (x's otherwise), as diffusers' RMSNorm returns.
static at::Tensor rmsnorm_prepare(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                  double eps) {
  check_activation(kRmsNorm, "x", x);
  if (weight) check_channel_vector(kRmsNorm, "weight", *weight, x.size(-1), x);
  check_eps(kRmsNorm, eps);
  return at::empty(x.sizes(), x.options().dtype(weight ? weight->scalar_type() : x.scalar_type()));
}

at::Tensor rmsnorm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  at::Tensor out = rmsnorm_prepare(x, weight, eps);
  if (out.numel() == 0) return out;
  const ltx_rows_t out_rows = rows_of(kRmsNorm, "out", out), x_rows = rows_of(kRmsNorm, "x", x);
  const int64_t hidden = x.size(-1);
  check_status(kRmsNorm, parallel_rows(out.numel() / hidden, hidden, [&](int64_t b, int64_t e) {
                 return ltx_rmsnorm_cpu(out_rows, x_rows, optional_data(weight),
                                        optional_dtype(weight), hidden, static_cast<float>(eps),
                                        b, e);
               }));
  return out;
}

#if defined(CUDA_KERNEL)
at::Tensor rmsnorm_cuda(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  at::Tensor out = rmsnorm_prepare(x, weight, eps);
  if (out.numel() == 0) return out;
  const c10::cuda::OptionalCUDAGuard device_guard(x.device());
  check_status(kRmsNorm,
               ltx_rmsnorm_cuda(rows_of(kRmsNorm, "out", out), rows_of(kRmsNorm, "x", x),
                                optional_data(weight), optional_dtype(weight), x.size(-1),
                                static_cast<float>(eps), at::cuda::getCurrentCUDAStream().stream()));
  return out;
}
#endif

// ------------------------------------------------------------------------------------------------
// Fused ops. Each impl serves both backends: the CUDA launcher on the current stream under a
// device guard, or the C implementation split over rows on the intra-op thread pool.
// ------------------------------------------------------------------------------------------------
template <typename CudaLaunch, typename CpuRows>
static void run_launcher(const char* op, const at::Tensor& x, int64_t rows, int64_t hidden,
                         const CudaLaunch& cuda_launch, const CpuRows& cpu_rows) {
  if (x.is_cuda()) {
#if defined(CUDA_KERNEL)
    const c10::cuda::OptionalCUDAGuard device_guard(x.device());
    check_status(op, cuda_launch(at::cuda::getCurrentCUDAStream().stream()));
    return;
#else
    LTX_CHECK(false, op, ": this build has no CUDA kernels");
#endif
  }
  check_status(op, parallel_rows(rows, hidden, cpu_rows));
}

// Optional per-row operand (scale, shift, gate) broadcast to x, described per row.
static ltx_rows_t optional_rows(const char* op, const char* name,
                                const std::optional<at::Tensor>& t, const at::Tensor& x,
                                bool upcast) {
  if (!t) return no_rows();
  check_operand_dtype(op, name, *t, x, upcast);
  return rows_of(op, name, broadcast_operand(op, name, *t, x, x.sizes()));
}

static ltx_vector_t optional_vector(const char* op, const char* name,
                                    const std::optional<at::Tensor>& t, const at::Tensor& x,
                                    int64_t length, bool upcast) {
  if (!t) return ltx_vector_t{nullptr, LTX_FLOAT32};
  check_channel_vector(op, name, *t, length, x);
  check_operand_dtype(op, name, *t, x, upcast);
  return ltx_vector_t{t->data_ptr(), to_ltx_dtype(t->scalar_type())};
}

// rmsnorm_modulate, layernorm_modulate and their add_ twins: one launcher. Returns (h, n); h is
// undefined without y.
static std::tuple<at::Tensor, at::Tensor> norm_modulate(
    const char* op, ltx_norm_kind_t kind, const at::Tensor& x, const std::optional<at::Tensor>& y,
    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
    const std::optional<at::Tensor>& gate, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool upcast) {
  check_activation(op, "x", x);
  check_eps(op, eps);
  const int64_t hidden = x.size(-1);
  ltx_norm_modulate_args_t args{};
  args.x = rows_of(op, "x", x);
  args.y = args.gate = args.residual_out = no_rows();
  args.scale = optional_rows(op, "scale", scale, x, upcast);
  args.shift = optional_rows(op, "shift", shift, x, upcast);
  if (scale && shift)
    LTX_CHECK(shift->scalar_type() == scale->scalar_type(), op, ": shift must have the dtype of scale (",
              scale->scalar_type(), "), got ", shift->scalar_type());
  at::Tensor h;
  if (y) {
    check_like_x(op, "y", *y, x);
    args.y = rows_of(op, "y", *y);
    args.gate = optional_rows(op, "gate", gate, x, upcast);
    const std::optional<at::Tensor>& modulation = scale ? scale : shift;
    if (gate && modulation)
      LTX_CHECK(gate->scalar_type() == modulation->scalar_type(), op, ": gate must have the dtype of ",
                scale ? "scale" : "shift", " (", modulation->scalar_type(), "), got ",
                gate->scalar_type());
    h = at::empty(x.sizes(), x.options());
    args.residual_out = rows_of(op, "h", h);
  }
  args.weight = optional_vector(op, "weight", weight, x, hidden, upcast);
  args.bias = optional_vector(op, "bias", bias, x, hidden, upcast);
  args.norm = kind;
  args.hidden = hidden;
  args.eps = static_cast<float>(eps);
  args.upcast = upcast ? 1 : 0;
  at::Tensor n = at::empty(x.sizes(), x.options());
  args.out = rows_of(op, "out", n);
  if (n.numel() == 0) return {h, n};
  run_launcher(
      op, x, n.numel() / hidden, hidden,
      [&](ltx_stream_t stream) { return ltx_norm_modulate_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_norm_modulate_cpu(&args, b, e); });
  return {h, n};
}

static constexpr const char* kRmsNormModulate = "ltx_kernels.rmsnorm_modulate";
static constexpr const char* kLayerNormModulate = "ltx_kernels.layernorm_modulate";
static constexpr const char* kAddRmsNormModulate = "ltx_kernels.add_rmsnorm_modulate";
static constexpr const char* kAddLayerNormModulate = "ltx_kernels.add_layernorm_modulate";

at::Tensor rmsnorm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                            const std::optional<at::Tensor>& shift,
                            const std::optional<at::Tensor>& weight, double eps, bool upcast) {
  return std::get<1>(norm_modulate(kRmsNormModulate, LTX_NORM_RMS, x, std::nullopt, scale, shift,
                                   std::nullopt, weight, std::nullopt, eps, upcast));
}

at::Tensor layernorm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                              const std::optional<at::Tensor>& shift,
                              const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps, bool upcast) {
  return std::get<1>(norm_modulate(kLayerNormModulate, LTX_NORM_LAYER, x, std::nullopt, scale,
                                   shift, std::nullopt, weight, bias, eps, upcast));
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm_modulate(
    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& gate,
    const std::optional<at::Tensor>& weight, double eps, bool upcast) {
  return norm_modulate(kAddRmsNormModulate, LTX_NORM_RMS, x, y, scale, shift, gate, weight,
                       std::nullopt, eps, upcast);
}

std::tuple<at::Tensor, at::Tensor> add_layernorm_modulate(
    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& gate,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool upcast) {
  return norm_modulate(kAddLayerNormModulate, LTX_NORM_LAYER, x, y, scale, shift, gate, weight,
                       bias, eps, upcast);
}

// ------------------------------------------------------------------------------------------------
// gated_residual
// ------------------------------------------------------------------------------------------------
static constexpr const char* kGatedResidual = "ltx_kernels.gated_residual";

at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& y,
                          const std::optional<at::Tensor>& gate, bool upcast) {
  const char* op = kGatedResidual;
  check_activation(op, "x", x);
  check_like_x(op, "y", y, x);
  const ltx_rows_t x_rows = rows_of(op, "x", x), y_rows = rows_of(op, "y", y);
  const ltx_rows_t gate_rows = optional_rows(op, "gate", gate, x, upcast);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const ltx_rows_t out_rows = rows_of(op, "out", out);
  const int64_t hidden = x.size(-1);
  run_launcher(
      op, x, out.numel() / hidden, hidden,
      [&](ltx_stream_t stream) {
        return ltx_gated_residual_cuda(out_rows, x_rows, y_rows, gate_rows, hidden, upcast,
                                       stream);
      },
      [&](int64_t b, int64_t e) {
        return ltx_gated_residual_cpu(out_rows, x_rows, y_rows, gate_rows, hidden, upcast, b, e);
      });
  return out;
}

// ------------------------------------------------------------------------------------------------
// rope, qk_rmsnorm_rope: one launcher (ltx_qk_norm_rope_*)
// ------------------------------------------------------------------------------------------------
static constexpr const char* kRope = "ltx_kernels.rope";
static constexpr const char* kQkRmsNormRope = "ltx_kernels.qk_rmsnorm_rope";

// How the rows of a q/k/x tensor are cut: `heads` heads of `head_dim` per launcher row.
struct RopeRows {
  int64_t heads = 1, head_dim = 0;
  bool token_rows = false;  // rows are tokens of a [..., H, Dh] tensor (heads contiguous)
};

// The rows of t as the launcher sees them: the last two dims merged when token_rows.
static at::Tensor launcher_rows_view(const at::Tensor& t, const RopeRows& layout) {
  if (!layout.token_rows) return t;
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end() - 2);
  std::vector<int64_t> strides(t.strides().begin(), t.strides().end() - 2);
  sizes.push_back(layout.heads * layout.head_dim);
  strides.push_back(1);
  return t.as_strided(sizes, strides);
}

// Describes tensor t (already checked) with its cos/sin tables for the launcher.
static ltx_rope_tensor_t rope_tensor(const char* op, const char* name, const at::Tensor& t,
                                     const at::Tensor& out, const std::optional<at::Tensor>& cos,
                                     const std::optional<at::Tensor>& sin,
                                     const std::optional<at::Tensor>& weight,
                                     const RopeRows& layout, int64_t rot_dim) {
  ltx_rope_tensor_t r{};
  r.x = rows_of(op, name, launcher_rows_view(t, layout));
  r.out = rows_of(op, "out", launcher_rows_view(out, layout));
  r.cos = r.sin = no_rows();
  if (cos) {
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end() - 1);
    shape.push_back(rot_dim);
    const std::optional<at::Tensor>* tables[2] = {&cos, &sin};
    ltx_rows_t* rows[2] = {&r.cos, &r.sin};
    int64_t* head_strides[2] = {&r.cos_head_stride, &r.sin_head_stride};
    for (int i = 0; i < 2; ++i) {
      const char* table_name = i == 0 ? "cos" : "sin";
      at::Tensor table = **tables[i];
      if (t.dim() == 4 && table.dim() == 2) table = table.unsqueeze(1);  // [S, r]: all heads
      const at::Tensor expanded = broadcast_operand(op, table_name, table, t, shape);
      if (layout.token_rows) {
        *head_strides[i] = expanded.stride(-2);
        *rows[i] = rows_of(op, table_name, expanded.select(-2, 0));
      } else {
        *head_strides[i] = 0;
        *rows[i] = rows_of(op, table_name, expanded);
      }
    }
  }
  r.weight = weight ? ltx_vector_t{weight->data_ptr(), to_ltx_dtype(weight->scalar_type())}
                    : ltx_vector_t{nullptr, LTX_FLOAT32};
  return r;
}

// Checks cos/sin (same shape and dtype, T or fp32, width head_dim or head_dim / 2 for halves) and
// returns the rotation width (0 without rotation).
static int64_t check_rope_tables(const char* op, const std::optional<at::Tensor>& cos,
                                 const std::optional<at::Tensor>& sin, const at::Tensor& x,
                                 int64_t head_dim, bool interleaved) {
  LTX_CHECK(cos.has_value() == sin.has_value(), op, ": cos and sin must both be given or both be None");
  if (!cos) return 0;
  check_same_device(op, "cos", *cos, "x", x);
  check_same_device(op, "sin", *sin, "x", x);
  LTX_CHECK(cos->sizes() == sin->sizes(), op, ": cos and sin must have the same shape, got ",
            cos->sizes(), " and ", sin->sizes());
  check_operand_dtype(op, "cos", *cos, x, /*upcast=*/true);
  LTX_CHECK(sin->scalar_type() == cos->scalar_type(), op, ": sin must have the dtype of cos (",
            cos->scalar_type(), "), got ", sin->scalar_type());
  LTX_CHECK(head_dim % 2 == 0, op, ": rotation needs an even last dimension, got ", head_dim);
  const int64_t width = cos->dim() >= 1 ? cos->size(-1) : -1;
  if (interleaved)
    LTX_CHECK(width == head_dim, op, ": cos must have last dimension ", head_dim, ", got shape ",
              cos->sizes());
  else
    LTX_CHECK(width == head_dim || 2 * width == head_dim, op, ": cos must have last dimension ",
              head_dim, " or ", head_dim / 2, " (both halves share it), got shape ", cos->sizes());
  return width;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                bool interleaved) {
  const char* op = kRope;
  check_activation(op, "x", x);
  RopeRows layout;
  layout.head_dim = x.size(-1);
  // Without a norm the grouping of heads into rows is free: a token's contiguous heads form one
  // row (one cos row per token when the table is shared by the heads).
  if (x.dim() == 4 && x.stride(-2) == x.size(-1)) {
    layout.token_rows = true;
    layout.heads = x.size(-2);
  }
  const int64_t rot_dim = check_rope_tables(op, cos, sin, x, layout.head_dim, interleaved);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  ltx_qk_norm_rope_args_t args{};
  args.tensors[0] = rope_tensor(op, "x", x, out, cos, sin, std::nullopt, layout, rot_dim);
  args.num_tensors = 1;
  args.heads = layout.heads;
  args.head_dim = layout.head_dim;
  args.rot_dim = rot_dim;
  args.normalize = 0;
  args.interleaved = interleaved ? 1 : 0;
  args.eps = 0.f;
  const int64_t row_len = layout.heads * layout.head_dim;
  run_launcher(
      op, x, out.numel() / row_len, row_len,
      [&](ltx_stream_t stream) { return ltx_qk_norm_rope_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_qk_norm_rope_cpu(&args, 0, b, e); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> qk_rmsnorm_rope(
    const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& q_weight,
    const std::optional<at::Tensor>& k_weight, const std::optional<at::Tensor>& cos,
    const std::optional<at::Tensor>& sin, double eps, bool across_heads, bool interleaved) {
  const char* op = kQkRmsNormRope;
  check_activation(op, "q", q);
  check_activation(op, "k", k);
  check_same_device(op, "k", k, "q", q);
  check_eps(op, eps);
  LTX_CHECK(k.scalar_type() == q.scalar_type(), op, ": k must have q's dtype ", q.scalar_type(),
            ", got ", k.scalar_type());
  RopeRows layout;
  layout.head_dim = q.size(-1);
  if (across_heads && q.dim() == 4) {
    layout.token_rows = true;
    layout.heads = q.size(-2);
  }
  LTX_CHECK(k.dim() == q.dim() && k.size(-1) == q.size(-1) &&
                (!layout.token_rows || k.size(-2) == q.size(-2)),
            op, ": k must have q's number of dims and head layout (q ", q.sizes(), ", k ",
            k.sizes(), ")");
  if (layout.token_rows) {
    for (const at::Tensor* t : {&q, &k})
      LTX_CHECK(t->stride(-2) == layout.head_dim || layout.heads == 1, op, ": with across_heads=True the ",
                t == &q ? "q" : "k", " heads must be contiguous (stride(-2) == ", layout.head_dim,
                "), got strides ", t->strides());
  }
  const int64_t row_len = layout.heads * layout.head_dim;
  auto weight_vector = [&](const char* name, const std::optional<at::Tensor>& w) {
    if (!w) return;
    check_channel_vector(op, name, *w, row_len, q);
    check_operand_dtype(op, name, *w, q, /*upcast=*/true);
  };
  weight_vector("q_weight", q_weight);
  weight_vector("k_weight", k_weight);
  const int64_t rot_dim = check_rope_tables(op, cos, sin, q, layout.head_dim, interleaved);
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  ltx_qk_norm_rope_args_t args{};
  args.tensors[0] = rope_tensor(op, "q", q, q_out, cos, sin, q_weight, layout, rot_dim);
  args.tensors[1] = rope_tensor(op, "k", k, k_out, cos, sin, k_weight, layout, rot_dim);
  args.num_tensors = 2;
  args.heads = layout.heads;
  args.head_dim = layout.head_dim;
  args.rot_dim = rot_dim;
  args.normalize = 1;
  args.interleaved = interleaved ? 1 : 0;
  args.eps = static_cast<float>(eps);
  if (row_len == 0 || q.numel() + k.numel() == 0) return {q_out, k_out};
  if (q.is_cuda()) {
    run_launcher(op, q, 0, row_len,
                 [&](ltx_stream_t stream) { return ltx_qk_norm_rope_cuda(&args, stream); },
                 [](int64_t, int64_t) { return LTX_OK; });
  } else {
    for (int i = 0; i < 2; ++i) {
      const int64_t rows = (i == 0 ? q : k).numel() / row_len;
      run_launcher(op, q, rows, row_len, [](ltx_stream_t) { return LTX_OK; },
                   [&](int64_t b, int64_t e) { return ltx_qk_norm_rope_cpu(&args, i, b, e); });
    }
  }
  return {q_out, k_out};
}

// ------------------------------------------------------------------------------------------------
// gelu, geglu
// ------------------------------------------------------------------------------------------------
static constexpr const char* kGelu = "ltx_kernels.gelu";
static constexpr const char* kGeglu = "ltx_kernels.geglu";

static ltx_gelu_approximate_t gelu_approximate(const char* op, c10::string_view approximate) {
  if (approximate == "none") return LTX_GELU_NONE;
  if (approximate == "tanh") return LTX_GELU_TANH;
  LTX_CHECK(false, op, ": approximate must be 'none' or 'tanh', got '", std::string(approximate),
            "'");
  return LTX_GELU_NONE;
}

static at::Tensor gelu_impl(const char* op, const at::Tensor& x, c10::string_view approximate,
                            bool gated) {
  check_activation(op, "x", x);
  const ltx_gelu_approximate_t kind = gelu_approximate(op, approximate);
  int64_t hidden = x.size(-1);
  if (gated) {
    LTX_CHECK(hidden % 2 == 0, op, ": x must have an even last dimension (hidden and gate halves), got ",
              x.sizes());
    hidden /= 2;
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = hidden;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  const ltx_rows_t out_rows = rows_of(op, "out", out), x_rows = rows_of(op, "x", x);
  run_launcher(
      op, x, out.numel() / hidden, hidden,
      [&](ltx_stream_t stream) {
        return ltx_gelu_cuda(out_rows, x_rows, hidden, kind, gated ? 1 : 0, stream);
      },
      [&](int64_t b, int64_t e) {
        return ltx_gelu_cpu(out_rows, x_rows, hidden, kind, gated ? 1 : 0, b, e);
      });
  return out;
}

at::Tensor gelu(const at::Tensor& x, c10::string_view approximate) {
  return gelu_impl(kGelu, x, approximate, false);
}

at::Tensor geglu(const at::Tensor& x, c10::string_view approximate) {
  return gelu_impl(kGeglu, x, approximate, true);
}

// ------------------------------------------------------------------------------------------------
// linear_gelu: one cuBLASLt GEMM with its GELU(-tanh) + bias epilogue, reached through
// at::_addmm_activation; no kernel of ours.
// ------------------------------------------------------------------------------------------------
static constexpr const char* kLinearGelu = "ltx_kernels.linear_gelu";

at::Tensor linear_gelu(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const char* op = kLinearGelu;
  check_activation(op, "x", x);
  check_same_device(op, "weight", weight, "x", x);
  const int64_t in_features = x.size(-1);
  LTX_CHECK(weight.dim() == 2 && weight.size(1) == in_features, op,
            ": weight must have shape [N, K] with K = x.shape[-1] = ", in_features, ", got ",
            weight.sizes());
  LTX_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype ",
            x.scalar_type(), ", got ", weight.scalar_type());
  const int64_t out_features = weight.size(0);
  if (bias) {
    check_same_device(op, "bias", *bias, "x", x);
    LTX_CHECK(bias->dim() == 1 && bias->size(0) == out_features, op,
              ": bias must have shape [N] = [", out_features, "], got ", bias->sizes());
    LTX_CHECK(bias->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ",
              x.scalar_type(), ", got ", bias->scalar_type());
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  const at::Tensor x2 = x.reshape({-1, in_features});
  // The fused path only where cuBLASLt takes it: contiguous, 16-byte aligned operands with
  // 16-byte multiples as leading dimensions and more than one row. Elsewhere torch's fallback
  // for _addmm_activation missed the tanh-GELU tolerance in our device tests, so those shapes,
  // and the CPU (whose _addmm_activation uses the erf GELU), take addmm followed by the GELU.
  auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const int64_t elems_per_16_bytes = 16 / x.element_size();
  const bool fused = x.is_cuda() && x2.is_contiguous() && weight.is_contiguous() &&
                     aligned(x2) && aligned(weight) && (!bias || aligned(*bias)) &&
                     in_features % elems_per_16_bytes == 0 &&
                     out_features % elems_per_16_bytes == 0 && x2.size(0) > 1;
  at::Tensor out;
  if (fused) {
    // cuBLASLt's epilogue needs a bias vector; without one a zero bias is used.
    const at::Tensor b = bias ? *bias : at::zeros({out_features}, x.options());
    out = at::_addmm_activation(b, x2, weight.t(), 1, 1, /*use_gelu=*/true);
  } else {
    out = bias ? at::addmm(*bias, x2, weight.t()) : at::mm(x2, weight.t());
    out = at::gelu(out, "tanh");
  }
  return out.view(shape);
}

// ------------------------------------------------------------------------------------------------
// Registration
// ------------------------------------------------------------------------------------------------
TORCH_LIBRARY_EXPAND(LTX_OPS_NAMESPACE, ops) {
  // y = x * rsqrt(mean(x^2, -1) + eps) [* weight], rounded as diffusers' RMSNorm; out dtype is
  // weight's (x's without weight).
  ops.def("rmsnorm(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor");
  ops.impl("rmsnorm", c10::kCPU, &rmsnorm_cpu);
#if defined(CUDA_KERNEL)
  ops.impl("rmsnorm", c10::kCUDA, &rmsnorm_cuda);
#endif

  // Fused ops (ltx_kernels.reference has the exact formulas). One impl per op serves both
  // backends; Meta comes from the fake implementations in _fake.py.
  const auto both = [&](const char* name, auto fn) {
    ops.impl(name, c10::kCPU, fn);
#if defined(CUDA_KERNEL)
    ops.impl(name, c10::kCUDA, fn);
#endif
  };
  ops.def("rmsnorm_modulate(Tensor x, Tensor? scale, Tensor? shift, Tensor? weight=None, "
          "float eps=1e-06, *, bool upcast=False) -> Tensor");
  both("rmsnorm_modulate", &rmsnorm_modulate);
  ops.def("layernorm_modulate(Tensor x, Tensor? scale, Tensor? shift, Tensor? weight=None, "
          "Tensor? bias=None, float eps=1e-06, *, bool upcast=False) -> Tensor");
  both("layernorm_modulate", &layernorm_modulate);
  ops.def("add_rmsnorm_modulate(Tensor x, Tensor y, Tensor? scale, Tensor? shift, "
          "Tensor? gate=None, Tensor? weight=None, float eps=1e-06, *, bool upcast=False) "
          "-> (Tensor, Tensor)");
  both("add_rmsnorm_modulate", &add_rmsnorm_modulate);
  ops.def("add_layernorm_modulate(Tensor x, Tensor y, Tensor? scale, Tensor? shift, "
          "Tensor? gate=None, Tensor? weight=None, Tensor? bias=None, float eps=1e-06, *, "
          "bool upcast=False) -> (Tensor, Tensor)");
  both("add_layernorm_modulate", &add_layernorm_modulate);
  ops.def("gated_residual(Tensor x, Tensor y, Tensor? gate=None, *, bool upcast=False) -> Tensor");
  both("gated_residual", &gated_residual);
  ops.def("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved=True) -> Tensor");
  both("rope", &rope);
  ops.def("qk_rmsnorm_rope(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor? cos, "
          "Tensor? sin, float eps=1e-06, bool across_heads=True, bool interleaved=True) "
          "-> (Tensor, Tensor)");
  both("qk_rmsnorm_rope", &qk_rmsnorm_rope);
  ops.def("gelu(Tensor x, str approximate='tanh') -> Tensor");
  both("gelu", &gelu);
  ops.def("geglu(Tensor x, str approximate='none') -> Tensor");
  both("geglu", &geglu);
  ops.def("linear_gelu(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  both("linear_gelu", &linear_gelu);
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
