// Bindings of the GEMM ops, through libtorch's GEMMs (cuBLAS/cuBLASLt on CUDA; no launcher of
// ours): linear_gelu (a GEMM with a GELU epilogue) and lora_linear (a Linear with LoRA adapters)
// with the gradients of lora_linear, which its autograd (autograd_ops.cpp) calls.
#include "binding_utils.h"
#include "torch_binding.h"

using namespace ltx_binding;

namespace {

// weight [N, K] with K = x.shape[-1], bias [N]: x's dtype and device (cpu_float64: x may be
// float64 on the CPU).
void check_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, bool cpu_float64 = false) {
  check_activation(op, "x", x, cpu_float64);
  check_same_device(op, "weight", weight, "x", x);
  const int64_t in_features = x.size(-1);
  LTX_CHECK(weight.dim() == 2 && weight.size(1) == in_features, op,
            ": weight must have shape [N, K] with K = x.shape[-1] = ", in_features, ", got ",
            weight.sizes());
  LTX_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must have x's dtype ",
            x.scalar_type(), ", got ", weight.scalar_type());
  if (bias) {
    check_same_device(op, "bias", *bias, "x", x);
    LTX_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), op,
              ": bias must have shape [N] = [", weight.size(0), "], got ", bias->sizes());
    LTX_CHECK(bias->scalar_type() == x.scalar_type(), op, ": bias must have x's dtype ",
              x.scalar_type(), ", got ", bias->scalar_type());
  }
}

// x's shape with the last dim out_features: the output of a Linear of x.
std::vector<int64_t> output_shape(const at::Tensor& x, int64_t out_features) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return shape;
}

}  // namespace

at::Tensor as_rows(const at::Tensor& t) {
  c10::SymInt rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.sym_size(d);
  return t.reshape_symint({rows, t.sym_size(-1)});
}

// linear_gelu: one cuBLASLt GEMM with its GELU(-tanh) + bias epilogue, reached through
// at::_addmm_activation. float64 on the CPU (gradcheck runs on this code: addmm, then the GELU).
at::Tensor linear_gelu(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const char* op = "ltx_kernels.linear_gelu";
  check_linear(op, x, weight, bias, /*cpu_float64=*/true);
  const int64_t in_features = x.size(-1), out_features = weight.size(0);
  const at::Tensor x2 = as_rows(x);
  // The fused path only where cuBLASLt takes it: contiguous, 16-byte aligned operands with
  // 16-byte multiples as leading dimensions and more than one row. Elsewhere torch's fallback
  // for _addmm_activation missed the tanh-GELU tolerance in our device tests, so those shapes,
  // and the CPU (whose _addmm_activation uses the erf GELU), take addmm followed by the GELU.
  auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const int64_t elems_per_16_bytes = 16 / x.element_size();
  // (K = 0 or N = 0: not through cuBLASLt; addmm gives bias or 0 for an empty K.)
  const bool fused = x.is_cuda() && in_features > 0 && out_features > 0 && x2.is_contiguous() &&
                     weight.is_contiguous() && aligned(x2) && aligned(weight) &&
                     (!bias || aligned(*bias)) && in_features % elems_per_16_bytes == 0 &&
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
  return out.view(output_shape(x, out_features));
}

// ------------------------------------------------------------------------------------------------
// lora_linear: out = x W^T + b, then for each adapter j, with A_j [r_j, K], B_j [N_j, r_j]:
//   t_j = x A_j^T;  out[..., o_j : o_j + N_j] += s_j * t_j B_j^T
// (peft's LoRA Linear: base_layer(x) + lora_B(lora_A(x)) * scaling, for each active adapter).
// Rounding to x's dtype: the base GEMM's output (fp32 accumulation, bias in fp32), t_j, and each
// update once (the GEMM's fp32 sum of the columns' value and s_j t_j B_j^T: beta 1, alpha s_j).
// The adapters' down-projections run as one GEMM over their concatenated A_j. float64 on the CPU
// (gradcheck runs on this code).
// ------------------------------------------------------------------------------------------------
namespace {

void check_lora(const char* op, const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, at::TensorList lora_a, at::TensorList lora_b,
                c10::ArrayRef<double> scaling, c10::IntArrayRef offsets) {
  check_linear(op, x, weight, bias, /*cpu_float64=*/true);
  const size_t adapters = lora_a.size();
  LTX_CHECK(lora_b.size() == adapters && scaling.size() == adapters && offsets.size() == adapters,
            op, ": lora_a, lora_b, scaling and offsets need one entry per adapter, got ",
            lora_a.size(), ", ", lora_b.size(), ", ", scaling.size(), " and ", offsets.size());
  const int64_t in_features = x.size(-1), out_features = weight.size(0);
  for (size_t j = 0; j < adapters; ++j) {
    const at::Tensor &a = lora_a[j], &b = lora_b[j];
    const std::string a_name = cat("lora_a[", j, "]"), b_name = cat("lora_b[", j, "]");
    check_same_device(op, a_name.c_str(), a, "x", x);
    check_same_device(op, b_name.c_str(), b, "x", x);
    LTX_CHECK(a.dim() == 2 && a.size(1) == in_features, op, ": ", a_name,
              " must have shape [r, K] with K = x.shape[-1] = ", in_features, ", got ", a.sizes());
    LTX_CHECK(b.dim() == 2 && b.size(1) == a.size(0), op, ": ", b_name,
              " must have shape [N_j, r] with r = ", a_name, ".shape[0] = ", a.size(0), ", got ",
              b.sizes());
    LTX_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(), op, ": ",
              a_name, " and ", b_name, " must have x's dtype ", x.scalar_type(), ", got ",
              a.scalar_type(), " and ", b.scalar_type());
    LTX_CHECK(offsets[j] >= 0 && offsets[j] + b.size(0) <= out_features, op, ": offsets[", j,
              "] = ", offsets[j], " puts ", b_name, "'s ", b.size(0),
              " output columns outside the N = ", out_features, " of weight");
  }
}

// The adapters' tensors side by side along dim (one adapter's as it is; undefined for none):
// A = [A_0; A_1; ...] (dim 0), U = [u_0 | u_1 | ...] (dim 1).
at::Tensor stacked(at::TensorList parts, int64_t dim) {
  if (parts.empty()) return at::Tensor();
  return parts.size() == 1 ? parts[0] : at::cat(parts, dim);
}

}  // namespace

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::TensorList lora_a,
                       at::TensorList lora_b, c10::ArrayRef<double> scaling,
                       c10::IntArrayRef offsets) {
  check_lora("ltx_kernels.lora_linear", x, weight, bias, lora_a, lora_b, scaling, offsets);
  const int64_t out_features = weight.size(0);
  const at::Tensor x2 = as_rows(x);
  at::Tensor out = bias ? at::addmm(*bias, x2, weight.t()) : at::mm(x2, weight.t());
  if (lora_a.empty()) return out.view(output_shape(x, out_features));
  const at::Tensor t = at::mm(x2, stacked(lora_a, 0).t());  // [x A_0^T | x A_1^T | ...]
  int64_t rank_offset = 0;
  for (size_t j = 0; j < lora_a.size(); ++j) {
    const int64_t rank = lora_a[j].size(0);
    out.narrow(1, offsets[j], lora_b[j].size(0))
        .addmm_(t.narrow(1, rank_offset, rank), lora_b[j].t(), /*beta=*/1, /*alpha=*/scaling[j]);
    rank_offset += rank;
  }
  return out.view(output_shape(x, out_features));
}

// The gradients for grad (out's gradient): with g_j the columns of adapter j, u_j = s_j g_j B_j,
// U = [u_0 | u_1 | ...] and A = [A_0; A_1; ...] (so the adapters' terms are one GEMM each),
// t_j = x A_j^T recomputed where a lora_b's gradient is wanted (one GEMM of K x sum of r_j a row):
//   dx = g W + U A;  dW = g^T x;  db = sum of g's rows;  [dA_0; dA_1; ...] = U^T x;
//   dB_j = s_j g_j^T t_j
// Only those asked for (wanted: x, weight, bias, then each A_j, then each B_j); the others are
// undefined. Each is rounded to x's dtype where its GEMM writes it (u_j and dB_j after s_j too).
std::vector<at::Tensor> lora_linear_backward(const at::Tensor& grad, const at::Tensor& x,
                                             const at::Tensor& weight, at::TensorList lora_a,
                                             at::TensorList lora_b, c10::ArrayRef<double> scaling,
                                             c10::IntArrayRef offsets,
                                             const std::vector<bool>& wanted) {
  const size_t adapters = lora_a.size();
  // (Rows flattened without reading x's concrete sizes: under torch.compile(dynamic=True) a
  // concrete size of x would specialize the traced backward to its sequence length.)
  const at::Tensor g = as_rows(grad), x2 = as_rows(x);
  auto any_wanted = [&](size_t first) {
    bool any = false;
    for (size_t j = 0; j < adapters; ++j) any = any || wanted[first + j];
    return any;
  };
  const bool want_a = any_wanted(3), want_b = any_wanted(3 + adapters);
  std::vector<at::Tensor> result(3 + 2 * adapters);
  at::Tensor dx = wanted[0] ? at::mm(g, weight) : at::Tensor();
  if (wanted[1]) result[1] = at::mm(g.t(), x2);
  if (wanted[2]) result[2] = g.sum(0);
  auto columns = [&](size_t j) { return g.narrow(1, offsets[j], lora_b[j].size(0)); };
  const at::Tensor all_a = dx.defined() || want_b ? stacked(lora_a, 0) : at::Tensor();
  if (adapters > 0 && (dx.defined() || want_a)) {
    std::vector<at::Tensor> u(adapters);
    for (size_t j = 0; j < adapters; ++j) {
      u[j] = at::mm(columns(j), lora_b[j]);
      if (scaling[j] != 1) u[j].mul_(scaling[j]);
    }
    const at::Tensor all_u = stacked(u, 1);
    if (dx.defined()) dx.addmm_(all_u, all_a);
    if (want_a) {
      const at::Tensor da = at::mm(all_u.t(), x2);
      int64_t rank_offset = 0;
      for (size_t j = 0; j < adapters; ++j) {
        const int64_t rank = lora_a[j].size(0);
        if (wanted[3 + j]) result[3 + j] = da.narrow(0, rank_offset, rank);
        rank_offset += rank;
      }
    }
  }
  if (want_b) {
    const at::Tensor t = at::mm(x2, all_a.t());
    int64_t rank_offset = 0;
    for (size_t j = 0; j < adapters; ++j) {
      const int64_t rank = lora_a[j].size(0);
      if (wanted[3 + adapters + j]) {
        const at::Tensor db = at::mm(columns(j).t(), t.narrow(1, rank_offset, rank));
        result[3 + adapters + j] = scaling[j] == 1 ? db : db.mul_(scaling[j]);
      }
      rank_offset += rank;
    }
  }
  if (dx.defined()) result[0] = dx.view_symint(x.sym_sizes());  // (symbolic under compile)
  return result;
}
