// Binding of attention (ltx_attention_*): q [B, Sq, H, D], k and v [B, Sk, H, D] read where they
// are (any strides with the last dim contiguous: slices of a fused qkv projection need no copy),
// out [B, Sq, H, D] contiguous, lse [B, H, Sq] when asked for (else empty). And of its 8-bit
// operands (ltx_quantize_attention_k_*, ltx_quantize_attention_v_*): k or v read the same way.
#include <cmath>

#include "../kernel_src/rows.h"
#include "binding_utils.h"
#include "torch_binding.h"

using namespace ltx_binding;

namespace {

// A [batch, len, heads, head_dim] tensor as the launcher's rows {batch, len, heads}, dims kept
// apart (the launcher indexes rows by (b, s, h)).
ltx_rows_t head_rows(const at::Tensor& t) {
  ltx_rows_t rows{};
  rows.data = present_data(t);
  rows.dtype = to_ltx_dtype(t.scalar_type());
  for (int d = 0; d < LTX_MAX_ROW_DIMS; ++d) {
    rows.size[d] = t.size(d);
    rows.stride[d] = t.stride(d);
  }
  return rows;
}

// q, k or v: 4-D on q's device, a float dtype (CUDA: float16 or bfloat16), last dim contiguous.
void check_operand(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  check_same_device(op, name, t, "q", q);
  LTX_CHECK(t.dim() == 4, op, ": ", name,
            " must be 4-D [batch, seq_len, heads, head_dim], got shape ", t.sizes());
  LTX_CHECK(!t.is_cuda() || t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op,
            ": ", name, " must be float16 or bfloat16 on CUDA, got ", t.scalar_type(),
            " (the CPU backend also takes float32 and float64)");
  check_activation(op, name, t, /*cpu_float64=*/true);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v,
                                             const std::optional<at::Tensor>& key_lengths,
                                             std::optional<double> scale, bool return_lse) {
  const char* op = "ltx_kernels.attention";
  check_operand(op, "q", q, q);
  check_operand(op, "k", k, q);
  check_operand(op, "v", v, q);
  const int64_t batch = q.size(0), q_len = q.size(1), heads = q.size(2), head_dim = q.size(3);
  LTX_CHECK(k.size(0) == batch && k.size(2) == heads && k.size(3) == head_dim, op,
            ": k must have q's batch, heads and head_dim [", batch, ", kv_len, ", heads, ", ",
            head_dim, "], got shape ", k.sizes());
  LTX_CHECK(v.sizes() == k.sizes(), op, ": v must have k's shape ", k.sizes(), ", got ", v.sizes());
  if (q.is_cuda()) {
    LTX_CHECK(ltx_attention_cuda_takes_head_dim(head_dim), op,
              ": head_dim (q.shape[-1]) must be 64 or 128 on CUDA, got ", head_dim,
              " (attend with torch.nn.functional.scaled_dot_product_attention instead)");
    for (const auto& [name, t] :
         {std::pair<const char*, const at::Tensor&>{"q", q}, {"k", k}, {"v", v}}) {
      const ltx_rows_t rows = head_rows(t);
      LTX_CHECK(ltx_num_rows(&rows) == 0 || ltx_rows_aligned(&rows, 2, 16), op, ": ", name,
                "'s rows must start at 16-byte boundaries on CUDA (data pointer, and strides of "
                "dims 0-2 multiples of 8 elements), got strides ",
                t.strides(), " at storage offset ", t.storage_offset(), "; pass ", name,
                ".contiguous()");
    }
  }
  ltx_vector_t lengths{nullptr, LTX_INT32};
  if (key_lengths) {
    const at::Tensor& n = *key_lengths;
    check_same_device(op, "key_lengths", n, "q", q);
    LTX_CHECK(n.scalar_type() == at::kInt || n.scalar_type() == at::kLong, op,
              ": key_lengths must be int32 or int64, got ", n.scalar_type());
    LTX_CHECK(n.dim() == 1 && n.size(0) == batch, op, ": key_lengths must have shape [batch] = [",
              batch, "], got ", n.sizes());
    LTX_CHECK(n.stride(0) == 1 || batch <= 1, op, ": key_lengths must be contiguous, got stride ",
              n.stride(0));
    lengths = ltx_vector_t{present_data(n), to_ltx_dtype(n.scalar_type())};
  }
  const double softmax_scale = scale          ? *scale
                               : head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim))
                                              : 1.0;

  at::Tensor out = at::empty(q.sizes(), q.options());
  const at::ScalarType lse_dtype = is_float64(q) ? at::kDouble : at::kFloat;
  at::Tensor lse = return_lse ? at::empty({batch, heads, q_len}, q.options().dtype(lse_dtype))
                              : at::empty({0}, q.options().dtype(lse_dtype));
  ltx_attention_args_t args{};
  args.out = head_rows(out);
  args.q = head_rows(q);
  args.k = head_rows(k);
  args.v = head_rows(v);
  args.lse = return_lse ? present_data(lse) : nullptr;
  args.key_lengths = lengths;
  args.head_dim = head_dim;
  args.scale = softmax_scale;
  // The C twin's work per query row is about head_dim * kv_len: the CPU grain's row length.
  const int64_t row_work = std::max<int64_t>(head_dim, 1) * std::max<int64_t>(k.size(1), 1);
  run_launcher(
      op, ltx_check_attention(&args), q, ltx_num_rows(&args.q), row_work,
      [&](ltx_stream_t stream) { return ltx_attention_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_attention_cpu(&args, b, e); });
  return {out, lse};
}

namespace {

// k or v of quantize_attention_k/v: 4-D, float32/float16/bfloat16, last dim contiguous, head_dim
// within the CUDA limit. Returns the launcher's arguments (codes and scale set by the caller) and
// the workspace it needs.
ltx_attention_quant_args_t attention_quant_args(const char* op, const char* name,
                                                const at::Tensor& x, at::Tensor& workspace) {
  LTX_CHECK(x.dim() == 4, op, ": ", name,
            " must be 4-D [batch, seq_len, heads, head_dim], got shape ", x.sizes());
  check_activation(op, name, x);
  LTX_CHECK(!x.is_cuda() || x.size(3) <= LTX_ATTENTION_QUANT_CUDA_MAX_HEAD_DIM, op, ": head_dim (",
            name, ".shape[-1]) must be at most ", LTX_ATTENTION_QUANT_CUDA_MAX_HEAD_DIM,
            " on CUDA, got ", x.size(3));
  const int64_t pairs = x.size(0) * x.size(2);
  workspace = at::empty({ltx_attention_quant_workspace(pairs, x.size(1), x.size(3))},
                        x.options().dtype(at::kFloat));
  ltx_attention_quant_args_t args{};
  args.x = head_rows(x);
  args.workspace = static_cast<float*>(present_data(workspace));
  args.head_dim = x.size(3);
  return args;
}

// Runs a launcher pair over the (batch, head) pairs of x.
template <typename Cuda, typename Cpu>
void run_attention_quant(const char* op, const ltx_check_t& check, const at::Tensor& x,
                         const Cuda& cuda, const Cpu& cpu) {
  // The C twin's work per pair is about kv_len * head_dim: the CPU grain's row length.
  const int64_t pair_work = std::max<int64_t>(x.size(1), 1) * std::max<int64_t>(x.size(3), 1);
  run_launcher(op, check, x, x.size(1) > 0 && x.size(3) > 0 ? x.size(0) * x.size(2) : 0, pair_work,
               cuda, cpu);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_attention_k(const at::Tensor& k) {
  const char* op = "ltx_kernels.quantize_attention_k";
  at::Tensor workspace;
  ltx_attention_quant_args_t args = attention_quant_args(op, "k", k, workspace);
  const int64_t batch = k.size(0), kv_len = k.size(1), heads = k.size(2);
  at::Tensor codes = at::empty(k.sizes(), k.options().dtype(at::kChar));
  at::Tensor scale =
      at::empty({batch, heads, (kv_len + LTX_ATTENTION_K_BLOCK - 1) / LTX_ATTENTION_K_BLOCK},
                k.options().dtype(at::kFloat));
  if (k.size(3) == 0) {  // blocks of no values: the scale of an amax of 0
    float empty_scale;
    ltx_i8_row_factor(0.f, &empty_scale);
    scale.fill_(empty_scale);
  }
  args.codes = present_data(codes);
  args.codes_dtype = LTX_INT8;
  args.scale = static_cast<float*>(present_data(scale));
  run_attention_quant(
      op, ltx_check_quantize_attention_k(&args), k,
      [&](ltx_stream_t stream) { return ltx_quantize_attention_k_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_quantize_attention_k_cpu(&args, b, e); });
  return {codes, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_attention_v(const at::Tensor& v) {
  const char* op = "ltx_kernels.quantize_attention_v";
  at::Tensor workspace;
  ltx_attention_quant_args_t args = attention_quant_args(op, "v", v, workspace);
  const int64_t batch = v.size(0), kv_len = v.size(1), heads = v.size(2), dim = v.size(3);
  at::Tensor codes = at::empty({batch, heads, dim, ltx_attention_v_pad(kv_len)},
                               v.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty({batch, heads, dim}, v.options().dtype(at::kFloat));
  if (kv_len == 0) {  // channels of no values: the scale of an amax of 0
    float empty_scale;
    ltx_e4m3_row_factor(0.f, &empty_scale);
    scale.fill_(empty_scale);
  }
  args.codes = present_data(codes);
  args.codes_dtype = LTX_FLOAT8_E4M3;
  args.scale = static_cast<float*>(present_data(scale));
  run_attention_quant(
      op, ltx_check_quantize_attention_v(&args), v,
      [&](ltx_stream_t stream) { return ltx_quantize_attention_v_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_quantize_attention_v_cpu(&args, b, e); });
  return {codes, scale};
}
