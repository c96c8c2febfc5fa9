/* RMSNorm and/or rotary embedding of q/k rows (portable C, the CPU backend), with the rounding
 * points of ltx_qk_norm_rope_cuda (see ltx_kernels.h). A row holds `heads` heads of `head_dim`
 * contiguous elements; the norm spans the whole row (sum of squares accumulated in double), the
 * rotation is per head with that head's cos/sin row, from the normalized values rounded to T.
 * Elementwise math in double, each operation rounded to fp32 where the CUDA kernel computes in
 * fp32 (exactly its results), kept in double for float64 tensors. Each rotation pair is read
 * before it is written, so out may alias x. */
#include "cpu_utils.h"

/* Element i of the row before its rounding to T: x * rstd * w (torch.nn.RMSNorm, weight
 * optional) when normalizing, x otherwise. */
static double normalized_element(const void* x_row, ltx_dtype_t act, const ltx_vector_t* weight,
                                 int normalize, double rstd, int64_t i) {
  double v = ltx_load_double(x_row, act, i);
  if (!normalize) return v;
  v = ltx_compute_precision(act, v * rstd);
  if (weight->data)
    v = ltx_compute_precision(act, v * ltx_load_double(weight->data, weight->dtype, i));
  return v;
}

/* One rotated element v * c + u * s, each product and the sum as computed for T. */
static double rotated(ltx_dtype_t act, double v, double c, double u, double s) {
  return ltx_compute_precision(
      act, ltx_compute_precision(act, v * c) + ltx_compute_precision(act, u * s));
}

int ltx_qk_norm_rope_cpu(const ltx_qk_norm_rope_args_t* args, int tensor, int64_t row_begin,
                         int64_t row_end) {
  const ltx_qk_norm_rope_args_t* a = args;
  const ltx_check_t check = ltx_check_qk_norm_rope(a);
  const ltx_rope_tensor_t* t;
  ltx_dtype_t act, table; /* T, cos/sin dtype */
  int64_t row_length, half, row, head, i;
  int status, rotate;
  if (check.status != LTX_OK) return check.status;
  if (tensor < 0 || tensor >= a->num_tensors) return LTX_ERR_INVALID_ARGUMENT;
  t = &a->tensors[tensor];
  status = ltx_cpu_status(check, row_begin, row_end, ltx_num_rows(&t->x));
  row_length = a->heads * a->head_dim;
  if (status != LTX_OK || row_length == 0) return status;
  act = a->tensors[0].x.dtype; /* T, shared by both tensors */
  table = t->cos.dtype;
  rotate = t->cos.data != NULL;
  half = a->head_dim / 2;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&t->x, row);
    void* out_row = ltx_row_ptr(&t->out, row);
    const void *cos_row, *sin_row;
    double rstd = 0.0;
    if (a->normalize) {
      double sumsq = 0.0;
      for (i = 0; i < row_length; ++i) {
        const double v = ltx_load_double(x_row, act, i);
        sumsq += v * v;
      }
      rstd = ltx_compute_precision(act, 1.0 / sqrt(sumsq / (double)row_length + (double)a->eps));
    }
    if (!rotate) { /* norm only (or a copy): one rounding to T */
      for (i = 0; i < row_length; ++i)
        ltx_store_double(out_row, act, i,
                         normalized_element(x_row, act, &t->weight, a->normalize, rstd, i));
      continue;
    }
    cos_row = ltx_row_ptr(&t->cos, row);
    sin_row = ltx_row_ptr(&t->sin, row);
    for (head = 0; head < a->heads; ++head) {
      /* Head `head` starts at element `base` of the row; its cos/sin values start at elements
       * cos_base/sin_base of the row's cos/sin rows. */
      const int64_t base = head * a->head_dim;
      const int64_t cos_base = head * t->cos_head_stride, sin_base = head * t->sin_head_stride;
      for (i = 0; i < half; ++i) {
        /* The pair (lo, hi) rotated together and the table entries of each. */
        const int64_t lo = a->interleaved ? 2 * i : i;
        const int64_t hi = a->interleaved ? 2 * i + 1 : i + half;
        const int64_t hi_table = a->rot_dim == a->head_dim ? hi : i;
        /* v rounded to T (a no-op without normalization: x already is T) */
        const double v_lo = ltx_round_double(
            act, normalized_element(x_row, act, &t->weight, a->normalize, rstd, base + lo));
        const double v_hi = ltx_round_double(
            act, normalized_element(x_row, act, &t->weight, a->normalize, rstd, base + hi));
        const double o_lo = rotated(act, v_lo, ltx_load_double(cos_row, table, cos_base + lo),
                                    -v_hi, ltx_load_double(sin_row, table, sin_base + lo));
        const double o_hi = rotated(act, v_hi, ltx_load_double(cos_row, table, cos_base + hi_table),
                                    v_lo, ltx_load_double(sin_row, table, sin_base + hi_table));
        ltx_store_double(out_row, act, base + lo, o_lo);
        ltx_store_double(out_row, act, base + hi, o_hi);
      }
    }
  }
  return LTX_OK;
}
