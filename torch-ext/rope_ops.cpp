// Bindings of rope and qk_rmsnorm_rope: one launcher (ltx_qk_norm_rope_*), rotation of one tensor
// or norm and rotation of q and k.
#include "binding_utils.h"
#include "torch_binding.h"

using namespace ltx_binding;

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

// Checks what is torch's of cos and sin (device, dtype, same shape) and returns the rotation
// width, rot_dim: their last dimension (0 without rotation). Whether it fits head_dim is a
// launcher rule.
static int64_t rope_tables_width(const char* op, const std::optional<at::Tensor>& cos,
                                 const std::optional<at::Tensor>& sin, const at::Tensor& x,
                                 int64_t head_dim) {
  for (const auto* table : {&cos, &sin}) {
    if (!*table) continue;
    const char* name = table == &cos ? "cos" : "sin";
    check_same_device(op, name, **table, "x", x);
    LTX_CHECK(is_supported_float((*table)->scalar_type()), op, ": ", name,
              " must be float32, float16 or bfloat16, got ", (*table)->scalar_type());
  }
  if (cos && sin)
    LTX_CHECK(cos->sizes() == sin->sizes(), op, ": cos and sin must have the same shape, got ",
              cos->sizes(), " and ", sin->sizes());
  const std::optional<at::Tensor>& table = cos ? cos : sin;
  if (!table) return 0;
  return table->dim() >= 1 ? table->size(-1) : head_dim;  // (a 0-d table fails to broadcast)
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
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end() - 1);
  shape.push_back(rot_dim);
  const std::optional<at::Tensor>* tables[2] = {&cos, &sin};
  ltx_rows_t* rows[2] = {&r.cos, &r.sin};
  int64_t* head_strides[2] = {&r.cos_head_stride, &r.sin_head_stride};
  for (int i = 0; i < 2; ++i) {
    if (!*tables[i]) continue;
    const char* table_name = i == 0 ? "cos" : "sin";
    at::Tensor table = **tables[i];
    if (t.dim() == 4 && table.dim() == 2) table = table.unsqueeze(1);  // [S, r]: all heads
    const at::Tensor expanded = broadcast_operand(op, table_name, table, t, shape);
    if (layout.token_rows && expanded.numel() > 0) {
      *head_strides[i] = expanded.stride(-2);
      *rows[i] = rows_of(op, table_name, expanded.select(-2, 0));
    } else {
      *head_strides[i] = 0;
      *rows[i] = rows_of(op, table_name, expanded);
    }
  }
  r.weight = weight ? ltx_vector_t{present_data(*weight), to_ltx_dtype(weight->scalar_type())}
                    : ltx_vector_t{nullptr, LTX_FLOAT32};
  return r;
}

// The launcher arguments shared by rope and qk_rmsnorm_rope (the tensors are filled in by the op).
static ltx_qk_norm_rope_args_t qk_norm_rope_args(const RopeRows& layout, int64_t rot_dim,
                                                 bool normalize, bool interleaved, double eps) {
  ltx_qk_norm_rope_args_t args{};
  args.heads = layout.heads;
  args.head_dim = layout.head_dim;
  args.rot_dim = rot_dim;
  args.normalize = normalize ? 1 : 0;
  args.interleaved = interleaved ? 1 : 0;
  args.eps = static_cast<float>(eps);
  return args;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                bool interleaved) {
  const char* op = "ltx_kernels.rope";
  check_activation(op, "x", x);
  RopeRows layout;
  layout.head_dim = x.size(-1);
  // Without a norm the grouping of heads into rows is free: a token's contiguous heads form one
  // row (one cos row per token when the table is shared by the heads).
  if (x.dim() == 4 && x.stride(-2) == x.size(-1)) {
    layout.token_rows = true;
    layout.heads = x.size(-2);
  }
  const int64_t rot_dim = rope_tables_width(op, cos, sin, x, layout.head_dim);
  at::Tensor out = at::empty(x.sizes(), x.options());
  ltx_qk_norm_rope_args_t args = qk_norm_rope_args(layout, rot_dim, false, interleaved, 0.0);
  args.tensors[0] = rope_tensor(op, "x", x, out, cos, sin, std::nullopt, layout, rot_dim);
  args.num_tensors = 1;
  const int64_t row_len = layout.heads * layout.head_dim;
  run_launcher(
      op, ltx_check_qk_norm_rope(&args), x, out.numel() / std::max<int64_t>(row_len, 1), row_len,
      [&](ltx_stream_t stream) { return ltx_qk_norm_rope_cuda(&args, stream); },
      [&](int64_t b, int64_t e) { return ltx_qk_norm_rope_cpu(&args, 0, b, e); },
      {{"tensors[0].x", "x"},
       {"tensors[0].cos", "cos"},
       {"tensors[0].sin", "sin"},
       {"tensors[0].out", "out"},
       {"rot_dim", "cos"}});
  return out;
}

std::tuple<at::Tensor, at::Tensor> qk_rmsnorm_rope(const at::Tensor& q, const at::Tensor& k,
                                                   const std::optional<at::Tensor>& q_weight,
                                                   const std::optional<at::Tensor>& k_weight,
                                                   const std::optional<at::Tensor>& cos,
                                                   const std::optional<at::Tensor>& sin, double eps,
                                                   bool across_heads, bool interleaved) {
  const char* op = "ltx_kernels.qk_rmsnorm_rope";
  check_activation(op, "q", q);
  check_activation(op, "k", k);
  check_same_device(op, "k", k, "q", q);
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
      LTX_CHECK(t->stride(-2) == layout.head_dim || layout.heads == 1, op,
                ": with across_heads=True the ", t == &q ? "q" : "k",
                " heads must be contiguous (stride(-2) == ", layout.head_dim, "), got strides ",
                t->strides());
  }
  const int64_t row_len = layout.heads * layout.head_dim;
  for (const auto* w : {&q_weight, &k_weight})
    if (*w) check_channel_vector(op, w == &q_weight ? "q_weight" : "k_weight", **w, row_len, q);
  const int64_t rot_dim = rope_tables_width(op, cos, sin, q, layout.head_dim);
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  ltx_qk_norm_rope_args_t args = qk_norm_rope_args(layout, rot_dim, true, interleaved, eps);
  args.tensors[0] = rope_tensor(op, "q", q, q_out, cos, sin, q_weight, layout, rot_dim);
  args.tensors[1] = rope_tensor(op, "k", k, k_out, cos, sin, k_weight, layout, rot_dim);
  args.num_tensors = 2;
  // The C twin takes the rows of one tensor at a time; the pool splits the q rows, then the k rows.
  const int64_t q_rows = q.numel() / std::max<int64_t>(row_len, 1);
  const int64_t rows = q_rows + k.numel() / std::max<int64_t>(row_len, 1);
  run_launcher(
      op, ltx_check_qk_norm_rope(&args), q, rows, row_len,
      [&](ltx_stream_t stream) { return ltx_qk_norm_rope_cuda(&args, stream); },
      [&](int64_t b, int64_t e) {
        int status = LTX_OK;
        if (b < q_rows) status = ltx_qk_norm_rope_cpu(&args, 0, b, std::min(e, q_rows));
        if (status == LTX_OK && e > q_rows)
          status = ltx_qk_norm_rope_cpu(&args, 1, std::max(b, q_rows) - q_rows, e - q_rows);
        return status;
      },
      {{"tensors[0].x", "q"},
       {"tensors[1].x", "k"},
       {"tensors[0].weight", "q_weight"},
       {"tensors[1].weight", "k_weight"},
       {"tensors[0].cos", "cos"},
       {"tensors[1].cos", "cos"},
       {"tensors[0].sin", "sin"},
       {"tensors[1].sin", "sin"},
       {"tensors[0].out", "q_out"},
       {"tensors[1].out", "k_out"},
       {"rot_dim", "cos"}});
  return {q_out, k_out};
}
