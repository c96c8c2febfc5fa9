// Binding of attention (ltx_attention_*): q [B, Sq, H, D], k and v [B, Sk, H, D] read where they
// are (any strides with the last dim contiguous: slices of a fused qkv projection need no copy),
// out [B, Sq, H, D] contiguous, lse [B, H, Sq] when asked for (else empty). attention_int8
// (ltx_attention_int8_*): the same over 8-bit codes and their scales (ltx_kernels.h), and the
// 8-bit operands of k and v (ltx_quantize_attention_k_*, ltx_quantize_attention_v_*), read the
// same way.
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

// key_lengths (optional) as the launchers' vector: int32 or int64 [batch] on ref's device.
ltx_vector_t key_lengths_vector(const char* op, const std::optional<at::Tensor>& key_lengths,
                                const char* ref_name, const at::Tensor& ref, int64_t batch) {
  if (!key_lengths) return ltx_vector_t{nullptr, LTX_INT32};
  const at::Tensor& n = *key_lengths;
  check_same_device(op, "key_lengths", n, ref_name, ref);
  LTX_CHECK(n.scalar_type() == at::kInt || n.scalar_type() == at::kLong, op,
            ": key_lengths must be int32 or int64, got ", n.scalar_type());
  LTX_CHECK(n.dim() == 1 && n.size(0) == batch, op, ": key_lengths must have shape [batch] = [",
            batch, "], got ", n.sizes());
  LTX_CHECK(n.stride(0) == 1 || batch <= 1, op, ": key_lengths must be contiguous, got stride ",
            n.stride(0));
  return ltx_vector_t{present_data(n), to_ltx_dtype(n.scalar_type())};
}

// The CUDA launcher's workspace of `bytes` (on the current device, inside run_launcher's guard:
// the launcher sizes it by that device's SMs) set into args; empty for none.
template <class Args>
at::Tensor launcher_workspace(int64_t bytes, const at::Tensor& like, Args* args) {
  if (bytes <= 0) return at::Tensor();
  at::Tensor workspace = at::empty({bytes}, like.options().dtype(at::kByte));
  args->workspace = workspace.data_ptr();
  args->workspace_bytes = bytes;
  return workspace;
}

// The softmax scale: `scale`, default head_dim^-0.5.
double default_scale(std::optional<double> scale, int64_t head_dim) {
  return scale ? *scale : head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
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
  const ltx_vector_t lengths = key_lengths_vector(op, key_lengths, "q", q, batch);
  const double softmax_scale = default_scale(scale, head_dim);

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
  at::Tensor workspace;
  run_launcher(
      op, ltx_check_attention(&args), q, ltx_num_rows(&args.q), row_work,
      [&](ltx_stream_t stream) {
        workspace = launcher_workspace(ltx_attention_cuda_workspace(&args), q, &args);
        return ltx_attention_cuda(&args, stream);
      },
      [&](int64_t b, int64_t e) { return ltx_attention_cpu(&args, b, e); });
  return {out, lse};
}

namespace {

// A code operand: 4-D, `dtype`, on ref's device, last dim contiguous.
void check_codes(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                 const char* shape, const at::Tensor& ref) {
  check_same_device(op, name, t, "q8", ref);
  LTX_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D ", shape, ", got shape ", t.sizes());
  LTX_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ",
            t.scalar_type());
  LTX_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1 || t.numel() == 0, op, ": ", name,
            " must have a contiguous last dimension (stride 1), got strides ", t.strides());
}

// A scale operand: contiguous float32 of `sizes` on ref's device.
void check_scales(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef sizes,
                  const char* shape, const at::Tensor& ref) {
  check_same_device(op, name, t, "q8", ref);
  LTX_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
            t.scalar_type());
  LTX_CHECK(t.sizes() == sizes, op, ": ", name, " must have shape ", shape, " = ", sizes, ", got ",
            t.sizes());
  LTX_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
}

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

std::tuple<at::Tensor, at::Tensor> attention_int8(const at::Tensor& q8, const at::Tensor& q_scale,
                                                  const at::Tensor& k8, const at::Tensor& k_scale,
                                                  const at::Tensor& v8, const at::Tensor& v_scale,
                                                  const std::optional<at::Tensor>& key_lengths,
                                                  std::optional<double> scale,
                                                  std::optional<at::ScalarType> out_dtype,
                                                  bool return_lse) {
  const char* op = "ltx_kernels.attention_int8";
  check_codes(op, "q8", q8, at::kChar, "[batch, seq_len, heads, head_dim]", q8);
  check_codes(op, "k8", k8, at::kChar, "[batch, kv_len, heads, head_dim]", q8);
  check_codes(op, "v8", v8, at::kFloat8_e4m3fn, "[batch, heads, head_dim, kv_len_padded]", q8);
  const int64_t batch = q8.size(0), q_len = q8.size(1), heads = q8.size(2), head_dim = q8.size(3);
  const int64_t kv_len = k8.size(1), key_blocks = (kv_len + LTX_ATTENTION_INT8_KEY_BLOCK - 1) /
                                                  LTX_ATTENTION_INT8_KEY_BLOCK;
  LTX_CHECK(k8.size(0) == batch && k8.size(2) == heads && k8.size(3) == head_dim, op,
            ": k8 must have q8's batch, heads and head_dim [", batch, ", kv_len, ", heads, ", ",
            head_dim, "], got shape ", k8.sizes());
  const int64_t kv_pad = ltx_attention_v_pad(kv_len);
  LTX_CHECK(
      v8.size(0) == batch && v8.size(1) == heads && v8.size(2) == head_dim && v8.size(3) >= kv_pad,
      op, ": v8 must have shape [batch, heads, head_dim, kv_len_padded] = [", batch, ", ", heads,
      ", ", head_dim, ", >= ", kv_pad,
      "] (V transposed, kv_len rounded up to 16, keys in quantize_attention_v's column order), "
      "got ",
      v8.sizes());
  check_scales(op, "q_scale", q_scale, {batch, q_len, heads}, "[batch, seq_len, heads]", q8);
  check_scales(op, "k_scale", k_scale, {batch, heads, key_blocks},
               "[batch, heads, ceil(kv_len / 128)]", q8);
  check_scales(op, "v_scale", v_scale, {batch, heads, head_dim}, "[batch, heads, head_dim]", q8);
  const at::ScalarType dtype = out_dtype.value_or(at::kBFloat16);
  if (q8.is_cuda()) {
    LTX_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": out_dtype must be bfloat16 or float16 on CUDA, got ", dtype);
    LTX_CHECK(ltx_attention_cuda_takes_head_dim(head_dim), op,
              ": head_dim (q8.shape[-1]) must be 64 or 128 on CUDA, got ", head_dim);
#if defined(CUDA_KERNEL)
    const int major = at::cuda::getDeviceProperties(q8.device().index())->major;
    LTX_CHECK(major == 9, op, ": the 8-bit kernel is for Hopper (compute capability 9.0), got ",
              q8.device(), " of compute capability ", major, ".x");
#endif
    for (const auto& [name, t] :
         {std::pair<const char*, const at::Tensor&>{"q8", q8}, {"k8", k8}, {"v8", v8}}) {
      const ltx_rows_t rows = head_rows(t);
      // (an empty operand has nothing to read: v8 of no keys has rows of length 0)
      LTX_CHECK(t.numel() == 0 || ltx_rows_aligned(&rows, 1, 16), op, ": ", name,
                "'s rows must start at 16-byte boundaries on CUDA (data pointer, and strides of "
                "dims 0-2 multiples of 16 elements), got strides ",
                t.strides(), " at storage offset ", t.storage_offset(), "; pass ", name,
                ".contiguous()", name[0] == 'v' ? " with kv_len_padded a multiple of 16" : "");
    }
  } else {
    LTX_CHECK(
        dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat || dtype == at::kDouble,
        op, ": out_dtype must be bfloat16, float16, float32 or float64, got ", dtype);
  }
  const ltx_vector_t lengths = key_lengths_vector(op, key_lengths, "q8", q8, batch);

  at::Tensor out = at::empty(q8.sizes(), q8.options().dtype(dtype));
  const at::ScalarType lse_dtype = dtype == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor lse = return_lse ? at::empty({batch, heads, q_len}, q8.options().dtype(lse_dtype))
                              : at::empty({0}, q8.options().dtype(lse_dtype));
  ltx_attention_int8_args_t args{};
  args.out = head_rows(out);
  args.q8 = head_rows(q8);
  args.k8 = head_rows(k8);
  args.v8 = head_rows(v8);  // rows {batch, heads, head_dim} of kv_len_padded columns
  args.q_scale = static_cast<const float*>(present_data(q_scale));
  args.k_scale = static_cast<const float*>(present_data(k_scale));
  args.v_scale = static_cast<const float*>(present_data(v_scale));
  args.lse = return_lse ? present_data(lse) : nullptr;
  args.key_lengths = lengths;
  args.head_dim = head_dim;
  args.kv_pad = v8.size(3);
  args.scale = default_scale(scale, head_dim);
  const int64_t row_work = std::max<int64_t>(head_dim, 1) * std::max<int64_t>(kv_len, 1);
  at::Tensor workspace;
  run_launcher(
      op, ltx_check_attention_int8(&args), q8, ltx_num_rows(&args.q8), row_work,
      [&](ltx_stream_t stream) {
        workspace = launcher_workspace(ltx_attention_int8_cuda_workspace(&args), q8, &args);
        return ltx_attention_int8_cuda(&args, stream);
      },
      [&](int64_t b, int64_t e) { return ltx_attention_int8_cpu(&args, b, e); });
  return {out, lse};
}

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
