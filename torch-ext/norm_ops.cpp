// Bindings of the norm ops: rmsnorm (ltx_rmsnorm_*) and the (residual +) norm + modulation ops
// rmsnorm_modulate, layernorm_modulate, their add_ twins and the quantized forms of the four
// (ltx_norm_modulate_*).
#include "binding_utils.h"
#include "torch_binding.h"

using namespace ltx_binding;

at::Tensor rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const char* op = "ltx_kernels.rmsnorm";
  check_activation(op, "x", x, /*cpu_float64=*/true);
  const int64_t hidden = x.size(-1);
  const ltx_vector_t w = optional_vector(op, "weight", weight, x, hidden, is_float64(x));
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

// An optional per-row operand (scale, shift, gate) broadcast to x, described per row (a copy
// kept in held where its broadcast has more levels than the launchers' rows).
static ltx_rows_t optional_rows(const char* op, const char* name,
                                const std::optional<at::Tensor>& t, const at::Tensor& x,
                                bool cpu_float64, Held& held) {
  if (!t) return no_rows();
  return operand_rows(op, name, broadcast_operand(op, name, *t, x, x.sizes(), cpu_float64), held);
}

// rmsnorm_modulate, layernorm_modulate, their add_ twins and the quantized forms of the four: one
// launcher. Returns (h, n, n_scale): h is undefined without y; with a format, n holds the quantized
// rows and n_scale their scales (quant_output), else n has x's dtype and n_scale is undefined.
// float64 (the C twin, in double) for gradcheck: not the quantized forms (no backward to check).
static std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_modulate(
    const char* op, ltx_norm_kind_t kind, const at::Tensor& x, const std::optional<at::Tensor>& y,
    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift,
    const std::optional<at::Tensor>& gate, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool upcast,
    std::optional<c10::string_view> format = std::nullopt) {
  check_activation(op, "x", x, /*cpu_float64=*/!format);
  const bool float64 = !format && is_float64(x);
  const int64_t hidden = x.size(-1);
  ltx_norm_modulate_args_t args{};
  Held held;
  args.x = rows_of(op, "x", x);
  args.y = args.gate = args.residual_out = no_rows();
  args.scale = optional_rows(op, "scale", scale, x, float64, held);
  args.shift = optional_rows(op, "shift", shift, x, float64, held);
  at::Tensor h;
  if (y) {
    check_like_x(op, "y", *y, x, float64);
    args.y = rows_of(op, "y", *y);
    args.gate = optional_rows(op, "gate", gate, x, float64, held);
    h = at::empty(x.sizes(), x.options());
    args.residual_out = rows_of(op, "h", h);
  }
  args.weight = optional_vector(op, "weight", weight, x, hidden, float64);
  args.bias = optional_vector(op, "bias", bias, x, hidden, float64);
  args.norm = kind;
  args.hidden = hidden;
  args.eps = static_cast<float>(eps);
  args.upcast = upcast ? 1 : 0;
  at::Tensor n, n_scale;
  if (format) {
    QuantOutput out = quant_output(op, x, *format);
    n = out.codes;
    n_scale = out.scale;
    args.quant = out.quant;
  } else {
    n = at::empty(x.sizes(), x.options());
  }
  args.out = rows_of(op, "out", n);
  run_launcher(
      op, ltx_check_norm_modulate(&args), x, n.numel() / std::max<int64_t>(hidden, 1), hidden,
      [&](ltx_stream_t stream) { return ltx_norm_modulate_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_norm_modulate_cpu(&args, b, e); },
      {{"residual_out", "h"}});
  return {h, n, n_scale};
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
  auto [h, n, unused] = norm_modulate("ltx_kernels.add_rmsnorm_modulate", LTX_NORM_RMS, x, y, scale,
                                      shift, gate, weight, std::nullopt, eps, upcast);
  return {h, n};
}

std::tuple<at::Tensor, at::Tensor> add_layernorm_modulate(const at::Tensor& x, const at::Tensor& y,
                                                          const std::optional<at::Tensor>& scale,
                                                          const std::optional<at::Tensor>& shift,
                                                          const std::optional<at::Tensor>& gate,
                                                          const std::optional<at::Tensor>& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          double eps, bool upcast) {
  auto [h, n, unused] = norm_modulate("ltx_kernels.add_layernorm_modulate", LTX_NORM_LAYER, x, y,
                                      scale, shift, gate, weight, bias, eps, upcast);
  return {h, n};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_modulate_quant(const at::Tensor& x,
                                                          const std::optional<at::Tensor>& scale,
                                                          const std::optional<at::Tensor>& shift,
                                                          const std::optional<at::Tensor>& weight,
                                                          double eps, bool upcast,
                                                          c10::string_view format) {
  auto [h, q, q_scale] =
      norm_modulate("ltx_kernels.rmsnorm_modulate_quant", LTX_NORM_RMS, x, std::nullopt, scale,
                    shift, std::nullopt, weight, std::nullopt, eps, upcast, format);
  return {q, q_scale};
}

std::tuple<at::Tensor, at::Tensor> layernorm_modulate_quant(
    const at::Tensor& x, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool upcast, c10::string_view format) {
  auto [h, q, q_scale] =
      norm_modulate("ltx_kernels.layernorm_modulate_quant", LTX_NORM_LAYER, x, std::nullopt, scale,
                    shift, std::nullopt, weight, bias, eps, upcast, format);
  return {q, q_scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rmsnorm_modulate_quant(
    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& gate,
    const std::optional<at::Tensor>& weight, double eps, bool upcast, c10::string_view format) {
  return norm_modulate("ltx_kernels.add_rmsnorm_modulate_quant", LTX_NORM_RMS, x, y, scale, shift,
                       gate, weight, std::nullopt, eps, upcast, format);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layernorm_modulate_quant(
    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& gate,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool upcast, c10::string_view format) {
  return norm_modulate("ltx_kernels.add_layernorm_modulate_quant", LTX_NORM_LAYER, x, y, scale,
                       shift, gate, weight, bias, eps, upcast, format);
}

// ------------------------------------------------------------------------------------------------
// norm_modulate_backward: the backward of every op above and of gated_residual
// (ltx_norm_backward_*).
// ------------------------------------------------------------------------------------------------
namespace {

// How a modulation operand (scale, shift, gate) of a backward is shared between rows: per leading
// dim of the rows' shape, whether the operand broadcasts along it.
struct Sharing {
  at::Tensor tensor;            // the operand (undefined: absent or its gradient not wanted)
  std::vector<bool> broadcast;  // per leading dim of h
  bool shared = false;          // broadcast along some dim of size > 1
};

Sharing sharing_of(const char* op, const char* name, const std::optional<at::Tensor>& t,
                   bool wanted, const at::Tensor& ref) {
  Sharing s;
  const int64_t lead = ref.dim() - 1;
  s.broadcast.assign(lead, false);
  if (!t || !wanted) return s;
  broadcast_operand(op, name, *t, ref, ref.sizes(), /*cpu_float64=*/true);  // checks only
  s.tensor = *t;
  const int64_t pad = ref.dim() - t->dim();
  for (int64_t i = 0; i < lead; ++i) {
    const int64_t size = i < pad ? 1 : t->size(i - pad);
    s.broadcast[i] = size == 1 && ref.size(i) != 1;
    s.shared = s.shared || s.broadcast[i];
  }
  return s;
}

// The gradient of a shared operand from the per-chunk sums [chunks, hidden]: summed over the
// chunks of each group (rows ref.shape[:first_group_dim] x groups), then over the operand's other
// broadcast dims; returned with the operand's shape and dtype.
at::Tensor reduce_sums(const at::Tensor& sums, const Sharing& s, const at::Tensor& ref,
                       int64_t first_group_dim, int64_t groups) {
  const int64_t hidden = ref.size(-1);
  const int64_t chunks_per_group = groups > 0 ? sums.size(0) / groups : 0;
  at::Tensor g = sums.view({groups, chunks_per_group, hidden}).sum(1);
  std::vector<int64_t> shape(ref.sizes().begin(), ref.sizes().begin() + first_group_dim);
  shape.push_back(hidden);
  g = g.view(shape);
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < first_group_dim; ++i)
    if (s.broadcast[i]) dims.push_back(i);
  if (!dims.empty()) g = g.sum(dims, /*keepdim=*/true);
  return g.reshape(s.tensor.sizes()).to(s.tensor.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
norm_modulate_backward(const std::optional<at::Tensor>& grad_out,
                       const std::optional<at::Tensor>& grad_h, const std::optional<at::Tensor>& h,
                       const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& gate,
                       const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& shift,
                       const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, double eps, bool layer_norm,
                       std::array<bool, 7> output_mask) {
  const char* op = "ltx_kernels.norm_modulate_backward";
  LTX_CHECK(grad_out || grad_h, op, ": needs grad_out or grad_h");
  LTX_CHECK(!grad_out || h, op, ": grad_out needs h (the normalized rows)");
  const at::Tensor& ref = grad_out ? *h : *grad_h;
  const char* ref_name = grad_out ? "h" : "grad_h";
  check_activation(op, ref_name, ref, /*cpu_float64=*/true);
  for (const auto& [name, t] :
       {std::pair<const char*, const std::optional<at::Tensor>*>{"grad_out", &grad_out},
        {"grad_h", &grad_h},
        {"y", &y}})
    if (*t) check_like_x(op, name, **t, ref, /*cpu_float64=*/true, ref_name);
  const int64_t hidden = ref.size(-1);
  LTX_CHECK(!ref.is_cuda() || hidden <= LTX_NORM_BACKWARD_MAX_HIDDEN, op,
            ": the CUDA kernel takes rows of up to ", int64_t{LTX_NORM_BACKWARD_MAX_HIDDEN},
            " elements, got ", hidden);
  const auto [want_x, want_y, want_gate, want_scale, want_shift, want_weight, want_bias] =
      output_mask;
  LTX_CHECK(!(want_gate && !y), op, ": the gradient of gate needs y");

  // Shared operands, and the groups of consecutive rows they are shared by: the rows' trailing
  // leading dims (from first_group_dim on) along which every shared operand broadcasts.
  const Sharing gate_s = sharing_of(op, "gate", gate, want_gate, ref);
  const Sharing scale_s = sharing_of(op, "scale", scale, want_scale, ref);
  const Sharing shift_s = sharing_of(op, "shift", shift, want_shift, ref);
  const int64_t lead = ref.dim() - 1;
  const bool weight_sums = (want_weight && weight) || (want_bias && bias);
  const bool any_shared = gate_s.shared || scale_s.shared || shift_s.shared;
  int64_t first_group_dim = lead;
  if (any_shared) {
    while (first_group_dim > 0) {
      const int64_t i = first_group_dim - 1;
      bool all = ref.size(i) == 1;
      if (!all) {
        all = true;
        for (const Sharing* s : {&gate_s, &scale_s, &shift_s})
          if (s->shared && !s->broadcast[i]) all = false;
      }
      if (!all) break;
      --first_group_dim;
    }
  } else if (weight_sums) {
    first_group_dim = 0;
  }
  int64_t group_rows = 1;
  for (int64_t i = first_group_dim; i < lead; ++i) group_rows *= ref.size(i);
  const int64_t rows =
      hidden > 0 ? ref.numel() / hidden : c10::multiply_integers(ref.sizes().slice(0, lead));
  group_rows = std::max<int64_t>(group_rows, 1);
  const bool any_sums = any_shared || weight_sums;
  const int64_t chunk_rows = any_sums ? ltx_norm_backward_chunk_rows(rows, group_rows) : 1;
  const int64_t chunks = ltx_norm_backward_chunks(rows, group_rows, chunk_rows);
  // (every group is empty when there are no rows: its operands' gradients are zeros)
  const int64_t groups = c10::multiply_integers(ref.sizes().slice(0, first_group_dim));

  const at::TensorOptions sum_options =
      ref.options().dtype(ref.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  auto sums_if = [&](bool wanted) {
    return wanted ? at::empty({chunks, hidden}, sum_options) : at::Tensor();
  };
  // Gradients not asked for are empty tensors (distinct ones: outputs never alias each other).
  auto none = [&] { return at::empty({0}, ref.options()); };
  at::Tensor dx = want_x ? at::empty(ref.sizes(), ref.options()) : none();
  at::Tensor dy = want_y ? at::empty(ref.sizes(), ref.options()) : none();
  at::Tensor dgate_rows = want_gate && gate && !gate_s.shared
                              ? at::empty(ref.sizes(), ref.options().dtype(gate->scalar_type()))
                              : at::Tensor();
  at::Tensor dscale_rows = want_scale && scale && !scale_s.shared
                               ? at::empty(ref.sizes(), ref.options().dtype(scale->scalar_type()))
                               : at::Tensor();
  const at::Tensor dgate_sum = sums_if(gate_s.shared), dscale_sum = sums_if(scale_s.shared),
                   dshift_sum = sums_if(shift_s.shared),
                   dweight_sum = sums_if(want_weight && weight),
                   dbias_sum = sums_if(want_bias && bias);

  ltx_norm_backward_args_t args{};
  Held held;  // (copies of operands and gradients whose rows the launcher cannot describe)
  auto rows_or_none = [&](const char* name, const std::optional<at::Tensor>& t) {
    return t ? operand_rows(op, name, *t, held) : no_rows();
  };
  auto row_operand = [&](const char* name, const std::optional<at::Tensor>& t) {
    return t ? operand_rows(op, name, broadcast_operand(op, name, *t, ref, ref.sizes(), true), held)
             : no_rows();
  };
  auto output_rows = [&](const char* name, const at::Tensor& t, bool wanted) {
    return wanted && t.defined() ? rows_of(op, name, t) : no_rows();
  };
  auto data_of = [](const at::Tensor& t) { return t.defined() ? present_data(t) : nullptr; };
  args.h = grad_out ? rows_of(op, "h", *h) : no_rows();
  args.y = rows_or_none("y", y);
  args.gate = row_operand("gate", gate);
  args.scale = grad_out ? row_operand("scale", scale) : no_rows();
  args.weight = grad_out ? optional_vector(op, "weight", weight, ref, hidden, true)
                         : ltx_vector_t{nullptr, LTX_FLOAT32};
  args.bias = grad_out ? optional_vector(op, "bias", bias, ref, hidden, true)
                       : ltx_vector_t{nullptr, LTX_FLOAT32};
  args.dout = rows_or_none("grad_out", grad_out);
  args.dh_out = rows_or_none("grad_h", grad_h);
  args.dx = output_rows("grad_x", dx, want_x);
  args.dy = output_rows("grad_y", dy, want_y);
  args.dscale = output_rows("grad_scale", dscale_rows, true);
  args.dgate = output_rows("grad_gate", dgate_rows, true);
  args.dscale_sum = data_of(dscale_sum);
  args.dshift_sum = data_of(dshift_sum);
  args.dgate_sum = data_of(dgate_sum);
  args.dweight_sum = data_of(dweight_sum);
  args.dbias_sum = data_of(dbias_sum);
  args.norm = layer_norm ? LTX_NORM_LAYER : LTX_NORM_RMS;
  args.hidden = hidden;
  args.group_rows = group_rows;
  args.chunk_rows = chunk_rows;
  args.eps = static_cast<float>(eps);
  run_launcher(
      op, ltx_check_norm_backward(&args), ref, chunks, hidden,
      [&](ltx_stream_t stream) { return ltx_norm_backward_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_norm_backward_cpu(&args, b, e); },
      {{"dout", "grad_out"},
       {"dh_out", "grad_h"},
       {"dx", "grad_x"},
       {"dy", "grad_y"},
       {"dscale", "grad_scale"},
       {"dgate", "grad_gate"}});

  // The shared operands' gradients from the chunk sums; per-row ones in the operand's shape.
  auto finish = [&](const Sharing& s, const at::Tensor& sums, const at::Tensor& per_row,
                    bool wanted, const std::optional<at::Tensor>& t) {
    if (!wanted || !t) return none();
    if (s.shared) return reduce_sums(sums, s, ref, first_group_dim, groups);
    return per_row.reshape(t->sizes());
  };
  at::Tensor dgate = finish(gate_s, dgate_sum, dgate_rows, want_gate, gate);
  at::Tensor dscale = finish(scale_s, dscale_sum, dscale_rows, want_scale, scale);
  at::Tensor dshift = none();
  if (want_shift && shift && grad_out) {
    dshift =
        shift_s.shared
            ? reduce_sums(dshift_sum, shift_s, ref, first_group_dim, groups)
            : at::empty(shift->sizes(), shift->options()).copy_(grad_out->reshape(shift->sizes()));
  }
  at::Tensor dweight =
      want_weight && weight ? dweight_sum.sum(0).to(weight->scalar_type()) : none();
  at::Tensor dbias = want_bias && bias ? dbias_sum.sum(0).to(bias->scalar_type()) : none();
  return {dx, dy, dgate, dscale, dshift, dweight, dbias};
}
