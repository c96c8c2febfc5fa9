/* Backward of the RMSNorm and/or rotary embedding of q/k rows (portable C, the CPU backend): the
 * gradients of ltx_qk_norm_rope_backward_cuda (see ltx_kernels.h), computed in double and rounded
 * once when stored. A row holds `heads` heads of `head_dim` elements; the transposed rotation is
 * per head, the norm spans the row. A chunk's weight-gradient sums accumulate in its row of the
 * sum matrix (fp32, or double for float64 tensors). */
#include "cpu_utils.h"

/* Element e of g = R^T d, the gradient of the rotation's input (d itself without rotation): with
 * (lo, hi) the pair of e's head the forward rotated together and the table entries of each,
 * g[lo] = d[lo] c[lo] + d[hi] s[hi],  g[hi] = d[hi] c[hi] - d[lo] s[lo]. */
static double unrotated_gradient(const ltx_qk_norm_rope_args_t* a, const ltx_rope_tensor_t* t,
                                 const void* grad_row, const void* cos_row, const void* sin_row,
                                 int64_t e) {
  const ltx_dtype_t act = t->x.dtype, table = t->cos.dtype;
  const int64_t half = a->head_dim / 2, head = e / a->head_dim, col = e - head * a->head_dim;
  const int64_t cos_base = head * t->cos_head_stride, sin_base = head * t->sin_head_stride;
  int64_t lo, hi, hi_table;
  if (!cos_row) return ltx_load_double(grad_row, act, e);
  lo = a->interleaved ? col & ~(int64_t)1 : col % half;
  hi = a->interleaved ? lo + 1 : lo + half;
  hi_table = a->rot_dim == a->head_dim ? hi : lo;
  lo += head * a->head_dim;
  hi += head * a->head_dim;
  if (e == lo)
    return ltx_load_double(grad_row, act, lo) * ltx_load_double(cos_row, table, cos_base + col) +
           ltx_load_double(grad_row, act, hi) *
               ltx_load_double(sin_row, table, sin_base + hi_table);
  return ltx_load_double(grad_row, act, hi) * ltx_load_double(cos_row, table, cos_base + hi_table) -
         ltx_load_double(grad_row, act, lo) *
             ltx_load_double(sin_row, table, sin_base + (lo - head * a->head_dim));
}

static double weight_at(const ltx_rope_tensor_t* t, int64_t i) {
  return t->weight.data ? ltx_load_double(t->weight.data, t->weight.dtype, i) : 1.0;
}

int ltx_qk_norm_rope_backward_cpu(const ltx_qk_norm_rope_backward_args_t* args, int tensor,
                                  int64_t chunk_begin, int64_t chunk_end) {
  const ltx_check_t check = ltx_check_qk_norm_rope_backward(args);
  const ltx_qk_norm_rope_args_t* a = &args->forward;
  const ltx_rope_tensor_t* t;
  ltx_dtype_t act, sum_dtype;
  int64_t rows, row_length, chunk, row, i;
  if (check.status != LTX_OK) return check.status;
  if (tensor < 0 || tensor >= a->num_tensors) return LTX_ERR_INVALID_ARGUMENT;
  t = &a->tensors[tensor];
  rows = ltx_num_rows(&t->x);
  if (chunk_begin < 0 || chunk_end > ltx_qk_norm_rope_backward_chunks(rows, args->chunk_rows))
    return LTX_ERR_INVALID_ARGUMENT;
  row_length = a->heads * a->head_dim;
  if (row_length == 0) return LTX_OK;
  act = t->x.dtype;
  sum_dtype = act == LTX_FLOAT64 ? LTX_FLOAT64 : LTX_FLOAT32;

  for (chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const int64_t first = chunk * args->chunk_rows;
    const int64_t end = first + args->chunk_rows < rows ? first + args->chunk_rows : rows;
    void* const sum_row =
        args->dweight_sum[tensor]
            ? (char*)args->dweight_sum[tensor] + chunk * row_length * ltx_dtype_size(sum_dtype)
            : NULL;
    if (sum_row) memset(sum_row, 0, (size_t)row_length * ltx_dtype_size(sum_dtype));
    for (row = first; row < end; ++row) {
      const void* const grad_row = ltx_row_ptr(&args->grad[tensor], row);
      const void* const cos_row = t->cos.data ? ltx_row_ptr(&t->cos, row) : NULL;
      const void* const sin_row = t->cos.data ? ltx_row_ptr(&t->sin, row) : NULL;
      void* const dx_row = ltx_row_ptr(&t->out, row);
      const void* x_row;
      double rstd, sumsq = 0.0, dot = 0.0;
      if (!a->normalize) {
        for (i = 0; i < row_length; ++i)
          ltx_store_double(dx_row, act, i, unrotated_gradient(a, t, grad_row, cos_row, sin_row, i));
        continue;
      }
      /* rstd of x, mean(g w xhat), then dx and the weight-gradient terms g xhat. */
      x_row = ltx_row_ptr(&t->x, row);
      for (i = 0; i < row_length; ++i) {
        const double x = ltx_load_double(x_row, act, i);
        sumsq += x * x;
      }
      rstd = 1.0 / sqrt(sumsq / (double)row_length + (double)a->eps);
      for (i = 0; i < row_length; ++i)
        dot += unrotated_gradient(a, t, grad_row, cos_row, sin_row, i) * weight_at(t, i) *
               ltx_load_double(x_row, act, i) * rstd;
      dot /= (double)row_length;
      for (i = 0; i < row_length; ++i) {
        const double g = unrotated_gradient(a, t, grad_row, cos_row, sin_row, i);
        const double xhat = ltx_load_double(x_row, act, i) * rstd;
        ltx_store_double(dx_row, act, i, rstd * (g * weight_at(t, i) - xhat * dot));
        if (sum_row)
          ltx_store_double(sum_row, sum_dtype, i,
                           ltx_load_double(sum_row, sum_dtype, i) + g * xhat);
      }
    }
  }
  return LTX_OK;
}
