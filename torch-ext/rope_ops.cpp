// Bindings of rope, qk_rmsnorm_rope and qk_rmsnorm_rope_quant: one launcher (ltx_qk_norm_rope_*),
// rotation of one tensor or norm and rotation of q and k (q's output quantized per head).
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
                                 int64_t head_dim, bool cpu_float64 = false) {
  for (const auto* table : {&cos, &sin}) {
    if (!*table) continue;
    const char* name = table == &cos ? "cos" : "sin";
    check_same_device(op, name, **table, "x", x);
    check_float(op, name, **table, cpu_float64);
  }
  if (cos && sin)
    LTX_CHECK(cos->sizes() == sin->sizes(), op, ": cos and sin must have the same shape, got ",
              cos->sizes(), " and ", sin->sizes());
  const std::optional<at::Tensor>& table = cos ? cos : sin;
  if (!table) return 0;
  return table->dim() >= 1 ? table->size(-1) : head_dim;  // (a 0-d table fails to broadcast)
}

// Describes tensor t (already checked) with its cos/sin tables for the launcher.
// Tables whose broadcast has more levels than the launchers' rows are copied into held.
static ltx_rope_tensor_t rope_tensor(const char* op, const char* name, const at::Tensor& t,
                                     const at::Tensor& out, const std::optional<at::Tensor>& cos,
                                     const std::optional<at::Tensor>& sin,
                                     const std::optional<at::Tensor>& weight,
                                     const RopeRows& layout, int64_t rot_dim, Held& held,
                                     bool cpu_float64 = false) {
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
    const at::Tensor expanded = broadcast_operand(op, table_name, table, t, shape, cpu_float64);
    if (layout.token_rows && expanded.numel() > 0) {
      *head_strides[i] = expanded.stride(-2);
      *rows[i] = rows_of(op, table_name, expanded.select(-2, 0));  // ([B, S, r]: always fits)
    } else {
      *head_strides[i] = 0;
      *rows[i] = operand_rows(op, table_name, expanded, held);
    }
  }
  r.weight = weight ? ltx_vector_t{present_data(*weight), to_ltx_dtype(weight->scalar_type())}
                    : ltx_vector_t{nullptr, LTX_FLOAT32};
  return r;
}

// The C twins take one tensor at a time: runs cpu(tensor, begin, end) on the part of the pool's
// range [b, e) that falls in tensor 0's items [0, first) and on the part in tensor 1's (counted
// from first), and returns the first failing status.
template <typename Cpu>
static int split_q_then_k(int64_t b, int64_t e, int64_t first, const Cpu& cpu) {
  int status = LTX_OK;
  if (b < first) status = cpu(0, b, std::min(e, first));
  if (status == LTX_OK && e > first) status = cpu(1, std::max(b, first) - first, e - first);
  return status;
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

// The rows of a rotation alone (rope and its backward). Without a norm the grouping of heads into
// rows is free: a token's contiguous heads form one row (one cos row per token when the table is
// shared by the heads), when it has at most max_row elements.
static RopeRows rotation_rows(const at::Tensor& x, int64_t max_row = INT64_MAX) {
  RopeRows layout;
  layout.head_dim = x.size(-1);
  if (x.dim() == 4 && x.stride(-2) == x.size(-1) && x.size(-2) * x.size(-1) <= max_row) {
    layout.token_rows = true;
    layout.heads = x.size(-2);
  }
  return layout;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                bool interleaved) {
  const char* op = "ltx_kernels.rope";
  check_activation(op, "x", x, /*cpu_float64=*/true);
  const RopeRows layout = rotation_rows(x);
  const int64_t rot_dim = rope_tables_width(op, cos, sin, x, layout.head_dim, is_float64(x));
  at::Tensor out = at::empty(x.sizes(), x.options());
  ltx_qk_norm_rope_args_t args = qk_norm_rope_args(layout, rot_dim, false, interleaved, 0.0);
  Held held;
  args.tensors[0] =
      rope_tensor(op, "x", x, out, cos, sin, std::nullopt, layout, rot_dim, held, is_float64(x));
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

// The rows of qk_rmsnorm_rope (and its backward): checks q and k (and their weights) and cuts them
// into heads, one head per launcher row or (across_heads) a token's heads per row. q may be float64
// on the CPU; k and the weights where cpu_float64 says (the forward: with a float64 q).
static RopeRows qk_rows(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const std::optional<at::Tensor>& q_weight,
                        const std::optional<at::Tensor>& k_weight, bool across_heads,
                        bool cpu_float64) {
  check_activation(op, "q", q, /*cpu_float64=*/true);
  check_activation(op, "k", k, cpu_float64);
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
      LTX_CHECK(t->stride(-2) == layout.head_dim || layout.heads == 1 || t->numel() == 0, op,
                ": with across_heads=True the ", t == &q ? "q" : "k",
                " heads must be contiguous (stride(-2) == ", layout.head_dim, "), got strides ",
                t->strides());
  }
  const int64_t row_len = layout.heads * layout.head_dim;
  for (const auto* w : {&q_weight, &k_weight})
    if (*w)
      check_channel_vector(op, w == &q_weight ? "q_weight" : "k_weight", **w, row_len, q,
                           cpu_float64);
  return layout;
}

// qk_rmsnorm_rope and its quantized form: normalizes and rotates q into q_out (its codes, with
// `quant`'s format) and k into k_out in one launch.
static void run_qk_rmsnorm_rope(const char* op, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& q_out, const at::Tensor& k_out,
                                const std::optional<at::Tensor>& q_weight,
                                const std::optional<at::Tensor>& k_weight,
                                const std::optional<at::Tensor>& cos,
                                const std::optional<at::Tensor>& sin, double eps, bool interleaved,
                                const RopeRows& layout, ltx_quant_t quant) {
  const bool float64 = is_float64(q);
  const int64_t row_len = layout.heads * layout.head_dim;
  const int64_t rot_dim = rope_tables_width(op, cos, sin, q, layout.head_dim, float64);
  ltx_qk_norm_rope_args_t args = qk_norm_rope_args(layout, rot_dim, true, interleaved, eps);
  Held held;
  args.tensors[0] =
      rope_tensor(op, "q", q, q_out, cos, sin, q_weight, layout, rot_dim, held, float64);
  args.tensors[1] =
      rope_tensor(op, "k", k, k_out, cos, sin, k_weight, layout, rot_dim, held, float64);
  args.num_tensors = 2;
  args.quant = quant;
  // The pool splits the q rows, then the k rows.
  const int64_t q_rows = q.numel() / std::max<int64_t>(row_len, 1);
  const int64_t rows = q_rows + k.numel() / std::max<int64_t>(row_len, 1);
  run_launcher(
      op, ltx_check_qk_norm_rope(&args), q, rows, row_len,
      [&](ltx_stream_t stream) { return ltx_qk_norm_rope_cuda(&args, stream); },
      [&](int64_t b, int64_t e) {
        return split_q_then_k(b, e, q_rows, [&](int tensor, int64_t begin, int64_t end) {
          return ltx_qk_norm_rope_cpu(&args, tensor, begin, end);
        });
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
}

std::tuple<at::Tensor, at::Tensor> qk_rmsnorm_rope(const at::Tensor& q, const at::Tensor& k,
                                                   const std::optional<at::Tensor>& q_weight,
                                                   const std::optional<at::Tensor>& k_weight,
                                                   const std::optional<at::Tensor>& cos,
                                                   const std::optional<at::Tensor>& sin, double eps,
                                                   bool across_heads, bool interleaved) {
  const char* op = "ltx_kernels.qk_rmsnorm_rope";
  const RopeRows layout = qk_rows(op, q, k, q_weight, k_weight, across_heads, is_float64(q));
  at::Tensor q_out = at::empty(q.sizes(), q.options());
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  run_qk_rmsnorm_rope(op, q, k, q_out, k_out, q_weight, k_weight, cos, sin, eps, interleaved,
                      layout, ltx_quant_t{LTX_QUANT_NONE, nullptr, 0});
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_rmsnorm_rope_quant(
    const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& q_weight,
    const std::optional<at::Tensor>& k_weight, const std::optional<at::Tensor>& cos,
    const std::optional<at::Tensor>& sin, double eps, bool across_heads, bool interleaved,
    c10::string_view format) {
  const char* op = "ltx_kernels.qk_rmsnorm_rope_quant";
  check_activation(op, "q", q);  // (no float64 form: the codes are of q's model-dtype value)
  const RopeRows layout = qk_rows(op, q, k, q_weight, k_weight, across_heads, false);
  QuantOutput q_out = quant_output(op, q, format);  // one scale per head (row of head_dim)
  q_out.quant.group = layout.head_dim;
  at::Tensor k_out = at::empty(k.sizes(), k.options());
  run_qk_rmsnorm_rope(op, q, k, q_out.codes, k_out, q_weight, k_weight, cos, sin, eps, interleaved,
                      layout, q_out.quant);
  return {q_out.codes, q_out.scale, k_out};
}

// ------------------------------------------------------------------------------------------------
// Backward (ltx_qk_norm_rope_backward_*): the forward's launcher arguments with the gradient dx as
// out, the output gradients, and the weight gradients as per-chunk partial sums summed here.
// ------------------------------------------------------------------------------------------------

// The launcher names of the backward's arguments -> the op's, for one or two tensors.
static const ArgNames kQkBackwardNames = {{"tensors[0].x", "q"},
                                          {"tensors[1].x", "k"},
                                          {"grad[0]", "grad_q"},
                                          {"grad[1]", "grad_k"},
                                          {"tensors[0].weight", "q_weight"},
                                          {"tensors[1].weight", "k_weight"},
                                          {"tensors[0].cos", "cos"},
                                          {"tensors[1].cos", "cos"},
                                          {"tensors[0].sin", "sin"},
                                          {"tensors[1].sin", "sin"},
                                          {"tensors[0].out", "grad_q"},
                                          {"tensors[1].out", "grad_k"},
                                          {"dweight_sum[0]", "q_weight"},
                                          {"dweight_sum[1]", "k_weight"},
                                          {"rot_dim", "cos"}};

static void check_backward_row(const char* op, const at::Tensor& x, int64_t row_len) {
  LTX_CHECK(!x.is_cuda() || row_len <= LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW, op,
            ": the CUDA kernel takes rows of up to ", int64_t{LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW},
            " elements, got ", row_len);
}

// Runs the backward launcher over the chunks of every tensor of `args` (the C twin splits them
// across threads, tensor by tensor).
static void run_backward(const char* op, ltx_qk_norm_rope_backward_args_t& args,
                         const at::Tensor& ref, int64_t row_len, ArgNames names) {
  int64_t chunks[2] = {0, 0};
  for (int i = 0; i < args.forward.num_tensors; ++i) {
    const int64_t* size = args.forward.tensors[i].x.size;
    chunks[i] = ltx_qk_norm_rope_backward_chunks(size[0] * size[1] * size[2], args.chunk_rows);
  }
  run_launcher(
      op, ltx_check_qk_norm_rope_backward(&args), ref, chunks[0] + chunks[1], row_len,
      [&](ltx_stream_t stream) { return ltx_qk_norm_rope_backward_cuda(&args, stream); },
      [&](int64_t b, int64_t e) {
        return split_q_then_k(b, e, chunks[0], [&](int tensor, int64_t begin, int64_t end) {
          return ltx_qk_norm_rope_backward_cpu(&args, tensor, begin, end);
        });
      },
      names);
}

at::Tensor rope_backward(const at::Tensor& grad, const at::Tensor& cos, const at::Tensor& sin,
                         bool interleaved) {
  const char* op = "ltx_kernels.rope_backward";
  check_activation(op, "grad_out", grad, /*cpu_float64=*/true);
  const at::Tensor grad_out = fitting_rows(grad);  // (an expanded gradient: copied if it must be)
  const RopeRows layout = rotation_rows(grad_out, LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW);
  check_backward_row(op, grad_out, layout.heads * layout.head_dim);
  const int64_t rot_dim = rope_tables_width(op, cos, sin, grad_out, layout.head_dim, true);
  at::Tensor grad_x = at::empty(grad_out.sizes(), grad_out.options());
  ltx_qk_norm_rope_backward_args_t args{};
  args.forward = qk_norm_rope_args(layout, rot_dim, false, interleaved, 0.0);
  // (a rotation's VJP does not read x: grad_out's rows describe it)
  Held held;
  args.forward.tensors[0] = rope_tensor(op, "grad_out", grad_out, grad_x, cos, sin, std::nullopt,
                                        layout, rot_dim, held, true);
  args.forward.num_tensors = 1;
  args.grad[0] = args.forward.tensors[0].x;
  const int64_t row_len = layout.heads * layout.head_dim;
  const int64_t rows = grad_out.numel() / std::max<int64_t>(row_len, 1);
  args.chunk_rows = ltx_qk_norm_rope_backward_chunk_rows(rows, row_len, 0);
  run_backward(op, args, grad_out, row_len,
               {{"tensors[0].x", "grad_out"},
                {"grad[0]", "grad_out"},
                {"tensors[0].cos", "cos"},
                {"tensors[0].sin", "sin"},
                {"tensors[0].out", "grad_x"},
                {"rot_dim", "cos"}});
  return grad_x;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_rmsnorm_rope_backward(
    const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& q, const at::Tensor& k,
    const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
    const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin, double eps,
    bool across_heads, bool interleaved, std::array<bool, 2> weight_grads) {
  const char* op = "ltx_kernels.qk_rmsnorm_rope_backward";
  const RopeRows layout = qk_rows(op, q, k, q_weight, k_weight, across_heads, true);
  check_like_x(op, "grad_q", dq, q, true, "q");
  check_like_x(op, "grad_k", dk, k, true, "k");
  // (expanded gradients: copied if they must be)
  const at::Tensor grad_q = fitting_rows(dq), grad_k = fitting_rows(dk);
  if (layout.token_rows)
    for (const at::Tensor* g : {&grad_q, &grad_k})
      LTX_CHECK(g->stride(-2) == layout.head_dim || layout.heads == 1 || g->numel() == 0, op,
                ": with across_heads=True the ", g == &grad_q ? "grad_q" : "grad_k",
                " heads must be contiguous (stride(-2) == ", layout.head_dim, "), got strides ",
                g->strides());
  const int64_t row_len = layout.heads * layout.head_dim;
  check_backward_row(op, q, row_len);
  const int64_t rot_dim = rope_tables_width(op, cos, sin, q, layout.head_dim, true);
  const bool want_q_weight = weight_grads[0] && q_weight,
             want_k_weight = weight_grads[1] && k_weight;
  const int64_t q_rows = q.numel() / std::max<int64_t>(row_len, 1);
  const int64_t k_rows = k.numel() / std::max<int64_t>(row_len, 1);

  ltx_qk_norm_rope_backward_args_t args{};
  args.forward = qk_norm_rope_args(layout, rot_dim, true, interleaved, eps);
  args.chunk_rows = ltx_qk_norm_rope_backward_chunk_rows(q_rows + k_rows, row_len,
                                                         want_q_weight || want_k_weight);
  at::Tensor grads[2] = {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options())};
  const at::TensorOptions sum_options =
      q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  at::Tensor sums[2];
  const at::Tensor* inputs[2] = {&q, &k};
  const at::Tensor* out_grads[2] = {&grad_q, &grad_k};
  const std::optional<at::Tensor>* weights[2] = {&q_weight, &k_weight};
  const bool wanted[2] = {want_q_weight, want_k_weight};
  const char* names[2] = {"q", "k"};
  Held held;
  for (int i = 0; i < 2; ++i) {
    args.forward.tensors[i] = rope_tensor(op, names[i], *inputs[i], grads[i], cos, sin, *weights[i],
                                          layout, rot_dim, held, true);
    args.grad[i] =
        rows_of(op, i == 0 ? "grad_q" : "grad_k", launcher_rows_view(*out_grads[i], layout));
    if (wanted[i]) {
      const int64_t rows = i == 0 ? q_rows : k_rows;
      sums[i] = at::empty({ltx_qk_norm_rope_backward_chunks(rows, args.chunk_rows), row_len},
                          sum_options);
      args.dweight_sum[i] = present_data(sums[i]);
    }
  }
  args.forward.num_tensors = 2;
  run_backward(op, args, q, row_len, kQkBackwardNames);
  auto weight_grad = [&](int i) {
    return wanted[i] ? sums[i].sum(0).to((*weights[i])->scalar_type())
                     : at::empty({0}, q.options());
  };
  return {grads[0], grads[1], weight_grad(0), weight_grad(1)};
}
