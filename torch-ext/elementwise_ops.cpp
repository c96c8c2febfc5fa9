// Bindings of the elementwise ops: gated_residual (ltx_gated_residual_*), gelu and geglu and their
// backward (ltx_gelu_*, ltx_gelu_backward_*), quantize (ltx_quantize_*).
#include "binding_utils.h"
#include "torch_binding.h"

using namespace ltx_binding;

at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& y,
                          const std::optional<at::Tensor>& gate, bool upcast) {
  const char* op = "ltx_kernels.gated_residual";
  check_activation(op, "x", x, /*cpu_float64=*/true);
  check_like_x(op, "y", y, x, is_float64(x));
  const ltx_rows_t x_rows = rows_of(op, "x", x), y_rows = rows_of(op, "y", y);
  Held held;
  const ltx_rows_t gate_rows =
      gate ? operand_rows(op, "gate",
                          broadcast_operand(op, "gate", *gate, x, x.sizes(), is_float64(x)), held)
           : no_rows();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const ltx_rows_t out_rows = rows_of(op, "out", out);
  const int64_t hidden = x.size(-1);
  run_launcher(
      op, ltx_check_gated_residual(&out_rows, &x_rows, &y_rows, &gate_rows, hidden, upcast), x,
      out.numel() / std::max<int64_t>(hidden, 1), hidden,
      [&](ltx_stream_t stream) {
        return ltx_gated_residual_cuda(out_rows, x_rows, y_rows, gate_rows, hidden, upcast, stream);
      },
      [&](int64_t b, int64_t e) {
        return ltx_gated_residual_cpu(out_rows, x_rows, y_rows, gate_rows, hidden, upcast, b, e);
      });
  return out;
}

static ltx_gelu_approximate_t gelu_approximate(const char* op, c10::string_view approximate) {
  if (approximate == "none") return LTX_GELU_NONE;
  if (approximate == "tanh") return LTX_GELU_TANH;
  LTX_CHECK(false, op, ": approximate must be 'none' or 'tanh', got '", std::string(approximate),
            "'");
  return LTX_GELU_NONE;
}

// The output shape of gelu (x's) or geglu (x's with half the last dim: hidden and gate halves).
static std::vector<int64_t> gelu_output_shape(const char* op, const at::Tensor& x, bool gated) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  LTX_CHECK(!gated || shape.back() % 2 == 0, op,
            ": x must have an even last dimension (hidden and gate halves), got ", x.sizes());
  if (gated) shape.back() /= 2;
  return shape;
}

// gelu and geglu: one launcher. Gated (GEGLU), x's rows hold the hidden and gate halves.
static at::Tensor gelu_impl(const char* op, const at::Tensor& x, c10::string_view approximate,
                            bool gated) {
  check_activation(op, "x", x, /*cpu_float64=*/true);
  const ltx_gelu_approximate_t kind = gelu_approximate(op, approximate);
  const std::vector<int64_t> shape = gelu_output_shape(op, x, gated);
  const int64_t hidden = shape.back();
  at::Tensor out = at::empty(shape, x.options());
  const ltx_rows_t out_rows = rows_of(op, "out", out), x_rows = rows_of(op, "x", x);
  run_launcher(
      op, ltx_check_gelu(&out_rows, &x_rows, hidden, kind, gated ? 1 : 0), x,
      out.numel() / std::max<int64_t>(hidden, 1), hidden,
      [&](ltx_stream_t stream) {
        return ltx_gelu_cuda(out_rows, x_rows, hidden, kind, gated ? 1 : 0, stream);
      },
      [&](int64_t b, int64_t e) {
        return ltx_gelu_cpu(out_rows, x_rows, hidden, kind, gated ? 1 : 0, b, e);
      });
  return out;
}

// The gradient of x for gelu/geglu's output gradient grad_out: x's shape (contiguous), x's dtype.
static at::Tensor gelu_backward_impl(const char* op, const at::Tensor& grad_out,
                                     const at::Tensor& x, c10::string_view approximate,
                                     bool gated) {
  check_activation(op, "x", x, /*cpu_float64=*/true);
  check_same_device(op, "grad_out", grad_out, "x", x);
  check_activation(op, "grad_out", grad_out, /*cpu_float64=*/true);
  const ltx_gelu_approximate_t kind = gelu_approximate(op, approximate);
  const std::vector<int64_t> shape = gelu_output_shape(op, x, gated);
  const int64_t hidden = shape.back();
  LTX_CHECK(grad_out.sizes() == c10::IntArrayRef(shape), op,
            ": grad_out must have the output's shape ", c10::IntArrayRef(shape), ", got ",
            grad_out.sizes());
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  const at::Tensor dout = fitting_rows(grad_out);  // (an expanded gradient: copied if it must be)
  const ltx_rows_t dx_rows = rows_of(op, "grad_x", grad_x),
                   dout_rows = rows_of(op, "grad_out", dout), x_rows = rows_of(op, "x", x);
  run_launcher(
      op, ltx_check_gelu_backward(&dx_rows, &dout_rows, &x_rows, hidden, kind, gated ? 1 : 0), x,
      x.numel() / std::max<int64_t>(x.size(-1), 1), hidden,
      [&](ltx_stream_t stream) {
        return ltx_gelu_backward_cuda(dx_rows, dout_rows, x_rows, hidden, kind, gated ? 1 : 0,
                                      stream);
      },
      [&](int64_t b, int64_t e) {
        return ltx_gelu_backward_cpu(dx_rows, dout_rows, x_rows, hidden, kind, gated ? 1 : 0, b, e);
      },
      {{"dout", "grad_out"}, {"out", "grad_x"}});
  return grad_x;
}

at::Tensor gelu(const at::Tensor& x, c10::string_view approximate) {
  return gelu_impl("ltx_kernels.gelu", x, approximate, false);
}

at::Tensor geglu(const at::Tensor& x, c10::string_view approximate) {
  return gelu_impl("ltx_kernels.geglu", x, approximate, true);
}

at::Tensor gelu_backward(const at::Tensor& grad_out, const at::Tensor& x,
                         c10::string_view approximate) {
  return gelu_backward_impl("ltx_kernels.gelu_backward", grad_out, x, approximate, false);
}

at::Tensor geglu_backward(const at::Tensor& grad_out, const at::Tensor& x,
                          c10::string_view approximate) {
  return gelu_backward_impl("ltx_kernels.geglu_backward", grad_out, x, approximate, true);
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, c10::string_view activation,
                                            c10::string_view approximate, c10::string_view format) {
  const char* op = "ltx_kernels.quantize";
  check_activation(op, "x", x);
  LTX_CHECK(activation == "none" || activation == "gelu", op,
            ": activation must be 'none' or 'gelu', got '", std::string(activation), "'");
  const ltx_activation_t kind = activation == "gelu" ? LTX_ACTIVATION_GELU : LTX_ACTIVATION_NONE;
  const ltx_gelu_approximate_t gelu_kind = gelu_approximate(op, approximate);
  const int64_t hidden = x.size(-1);
  const QuantOutput out = quant_output(op, x, format);
  const ltx_rows_t q_rows = rows_of(op, "out", out.codes), x_rows = rows_of(op, "x", x);
  run_launcher(
      op, ltx_check_quantize(&q_rows, &out.quant, &x_rows, hidden, kind, gelu_kind), x,
      out.codes.numel() / std::max<int64_t>(hidden, 1), hidden,
      [&](ltx_stream_t stream) {
        return ltx_quantize_cuda(q_rows, out.quant, x_rows, hidden, kind, gelu_kind, stream);
      },
      [&](int64_t b, int64_t e) {
        return ltx_quantize_cpu(q_rows, out.quant, x_rows, hidden, kind, gelu_kind, b, e);
      });
  return {out.codes, out.scale};
}
