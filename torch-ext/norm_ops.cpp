// Bindings of the norm ops: rmsnorm (ltx_rmsnorm_*) and the (residual +) norm + modulation ops
// rmsnorm_modulate, layernorm_modulate and their add_ twins (ltx_norm_modulate_*).
#include "binding_utils.h"
#include "torch_binding.h"

using namespace ltx_binding;

at::Tensor rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const char* op = "ltx_kernels.rmsnorm";
  check_activation(op, "x", x);
  const int64_t hidden = x.size(-1);
  const ltx_vector_t w = optional_vector(op, "weight", weight, x, hidden);
  // Of weight's dtype when there is a weight (x's otherwise), as diffusers' RMSNorm returns.
  at::Tensor out =
      at::empty(x.sizes(), x.options().dtype(weight ? weight->scalar_type() : x.scalar_type()));
  const ltx_rows_t out_rows = rows_of(op, "out", out), x_rows = rows_of(op, "x", x);
  const float eps_ = static_cast<float>(eps);
  run_launcher(
      op, ltx_check_rmsnorm(&out_rows, &x_rows, w.data, w.dtype, hidden, eps_), x,
      out.numel() / std::max<int64_t>(hidden, 1), hidden,
      [&](ltx_stream_t stream) {
        return ltx_rmsnorm_cuda(out_rows, x_rows, w.data, w.dtype, hidden, eps_, stream);
      },
      [&](int64_t b, int64_t e) {
        return ltx_rmsnorm_cpu(out_rows, x_rows, w.data, w.dtype, hidden, eps_, b, e);
      });
  return out;
}

// An optional per-row operand (scale, shift, gate) broadcast to x, described per row.
static ltx_rows_t optional_rows(const char* op, const char* name,
                                const std::optional<at::Tensor>& t, const at::Tensor& x) {
  if (!t) return no_rows();
  return rows_of(op, name, broadcast_operand(op, name, *t, x, x.sizes()));
}

// rmsnorm_modulate, layernorm_modulate and their add_ twins: one launcher. Returns (h, n); h is
// undefined without y.
static std::tuple<at::Tensor, at::Tensor> norm_modulate(
    const char* op, ltx_norm_kind_t kind, const at::Tensor& x, const std::optional<at::Tensor>& y,
    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
    const std::optional<at::Tensor>& gate, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool upcast) {
  check_activation(op, "x", x);
  const int64_t hidden = x.size(-1);
  ltx_norm_modulate_args_t args{};
  args.x = rows_of(op, "x", x);
  args.y = args.gate = args.residual_out = no_rows();
  args.scale = optional_rows(op, "scale", scale, x);
  args.shift = optional_rows(op, "shift", shift, x);
  at::Tensor h;
  if (y) {
    check_like_x(op, "y", *y, x);
    args.y = rows_of(op, "y", *y);
    args.gate = optional_rows(op, "gate", gate, x);
    h = at::empty(x.sizes(), x.options());
    args.residual_out = rows_of(op, "h", h);
  }
  args.weight = optional_vector(op, "weight", weight, x, hidden);
  args.bias = optional_vector(op, "bias", bias, x, hidden);
  args.norm = kind;
  args.hidden = hidden;
  args.eps = static_cast<float>(eps);
  args.upcast = upcast ? 1 : 0;
  at::Tensor n = at::empty(x.sizes(), x.options());
  args.out = rows_of(op, "out", n);
  run_launcher(
      op, ltx_check_norm_modulate(&args), x, n.numel() / std::max<int64_t>(hidden, 1), hidden,
      [&](ltx_stream_t stream) { return ltx_norm_modulate_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_norm_modulate_cpu(&args, b, e); },
      {{"residual_out", "h"}});
  return {h, n};
}

at::Tensor rmsnorm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                            const std::optional<at::Tensor>& shift,
                            const std::optional<at::Tensor>& weight, double eps, bool upcast) {
  return std::get<1>(norm_modulate("ltx_kernels.rmsnorm_modulate", LTX_NORM_RMS, x, std::nullopt,
                                   scale, shift, std::nullopt, weight, std::nullopt, eps, upcast));
}

at::Tensor layernorm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                              const std::optional<at::Tensor>& shift,
                              const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps, bool upcast) {
  return std::get<1>(norm_modulate("ltx_kernels.layernorm_modulate", LTX_NORM_LAYER, x,
                                   std::nullopt, scale, shift, std::nullopt, weight, bias, eps,
                                   upcast));
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm_modulate(const at::Tensor& x, const at::Tensor& y,
                                                        const std::optional<at::Tensor>& scale,
                                                        const std::optional<at::Tensor>& shift,
                                                        const std::optional<at::Tensor>& gate,
                                                        const std::optional<at::Tensor>& weight,
                                                        double eps, bool upcast) {
  return norm_modulate("ltx_kernels.add_rmsnorm_modulate", LTX_NORM_RMS, x, y, scale, shift, gate,
                       weight, std::nullopt, eps, upcast);
}

std::tuple<at::Tensor, at::Tensor> add_layernorm_modulate(const at::Tensor& x, const at::Tensor& y,
                                                          const std::optional<at::Tensor>& scale,
                                                          const std::optional<at::Tensor>& shift,
                                                          const std::optional<at::Tensor>& gate,
                                                          const std::optional<at::Tensor>& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          double eps, bool upcast) {
  return norm_modulate("ltx_kernels.add_layernorm_modulate", LTX_NORM_LAYER, x, y, scale, shift,
                       gate, weight, bias, eps, upcast);
}
