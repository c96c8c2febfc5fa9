/* Backward of (residual +) RMSNorm/LayerNorm + AdaLN modulation, rmsnorm and gated_residual
 * (portable C, the CPU backend): the gradients of ltx_norm_backward_cuda (see ltx_kernels.h),
 * computed in double and rounded once when stored. A chunk's sums over its rows accumulate in its
 * row of each sum matrix (fp32, or double for float64 tensors); nothing is allocated, so the row
 * terms are recomputed from h on each pass over a row. */
#include "cpu_utils.h"

/* The row pointers of one row's operands (NULL when absent). */
typedef struct norm_backward_row {
  const void *h, *y, *gate, *scale, *dout, *dh_out;
  void *dx, *dy, *dscale, *dgate;
} norm_backward_row_t;

static const void* row_or_null(const ltx_rows_t* r, int64_t row) {
  return r->data ? ltx_row_ptr(r, row) : NULL;
}

static double vector_at(const ltx_vector_t* v, int64_t i, double absent) {
  return v->data ? ltx_load_double(v->data, v->dtype, i) : absent;
}

/* sum[i] += v in a sum matrix row of dtype `dtype`. */
static void accumulate(void* sum_row, ltx_dtype_t dtype, int64_t i, double v) {
  if (sum_row) ltx_store_double(sum_row, dtype, i, ltx_load_double(sum_row, dtype, i) + v);
}

/* The normalized element yhat and the factor dn / g = 1 + scale at column i. */
static double normalized(const ltx_norm_backward_args_t* a, const norm_backward_row_t* r, int64_t i,
                         double mean, double rstd) {
  return (ltx_load_double(r->h, a->h.dtype, i) - mean) * rstd;
}

static double scale_factor(const ltx_norm_backward_args_t* a, const norm_backward_row_t* r,
                           int64_t i) {
  return r->scale ? 1.0 + ltx_load_double(r->scale, a->scale.dtype, i) : 1.0;
}

int ltx_norm_backward_cpu(const ltx_norm_backward_args_t* args, int64_t chunk_begin,
                          int64_t chunk_end) {
  const ltx_norm_backward_args_t* a = args;
  const ltx_check_t check = ltx_check_norm_backward(a);
  ltx_dtype_t t, sum_dtype;
  int64_t rows, chunks_per_group, chunk, row, i, hidden;
  int layer, k;
  if (check.status != LTX_OK) return check.status;
  rows = ltx_num_rows(a->dout.data ? &a->h : &a->dh_out);
  if (chunk_begin < 0 || chunk_end > ltx_norm_backward_chunks(rows, a->group_rows, a->chunk_rows))
    return LTX_ERR_INVALID_ARGUMENT;
  hidden = a->hidden;
  if (hidden == 0) return LTX_OK;
  t = a->dout.data ? a->h.dtype : a->dh_out.dtype;
  sum_dtype = t == LTX_FLOAT64 ? LTX_FLOAT64 : LTX_FLOAT32;
  layer = a->norm == LTX_NORM_LAYER;
  chunks_per_group = (a->group_rows + a->chunk_rows - 1) / a->chunk_rows;

  for (chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const int64_t group = chunk / chunks_per_group, part = chunk % chunks_per_group;
    const int64_t first = group * a->group_rows + part * a->chunk_rows;
    const int64_t end = first + a->chunk_rows < (group + 1) * a->group_rows
                            ? first + a->chunk_rows
                            : (group + 1) * a->group_rows;
    const int64_t offset = chunk * hidden * ltx_dtype_size(sum_dtype);
    void* const sums[5] = {a->dscale_sum, a->dshift_sum, a->dgate_sum, a->dweight_sum,
                           a->dbias_sum};
    void* sum_rows[5];
    for (k = 0; k < 5; ++k) {
      sum_rows[k] = sums[k] ? (char*)sums[k] + offset : NULL;
      if (sum_rows[k]) memset(sum_rows[k], 0, (size_t)hidden * ltx_dtype_size(sum_dtype));
    }
    for (row = first; row < end; ++row) {
      norm_backward_row_t r;
      double mean = 0.0, rstd = 0.0, dot = 0.0, total = 0.0;
      r.h = row_or_null(&a->h, row);
      r.y = row_or_null(&a->y, row);
      r.gate = row_or_null(&a->gate, row);
      r.scale = row_or_null(&a->scale, row);
      r.dout = row_or_null(&a->dout, row);
      r.dh_out = row_or_null(&a->dh_out, row);
      r.dx = (void*)row_or_null(&a->dx, row);
      r.dy = (void*)row_or_null(&a->dy, row);
      r.dscale = (void*)row_or_null(&a->dscale, row);
      r.dgate = (void*)row_or_null(&a->dgate, row);

      if (r.dout) {
        /* Statistics of h, then mean(dn * w * yhat) and (Layer) mean(dn * w). */
        double sum = 0.0;
        if (layer) {
          for (i = 0; i < hidden; ++i) mean += ltx_load_double(r.h, t, i);
          mean /= (double)hidden;
        }
        for (i = 0; i < hidden; ++i) {
          const double deviation = ltx_load_double(r.h, t, i) - mean;
          sum += deviation * deviation;
        }
        rstd = 1.0 / sqrt(sum / (double)hidden + (double)a->eps);
        for (i = 0; i < hidden; ++i) {
          const double dyw = ltx_load_double(r.dout, t, i) * scale_factor(a, &r, i) *
                             vector_at(&a->weight, i, 1.0);
          dot += dyw * normalized(a, &r, i, mean, rstd);
          total += dyw;
        }
        dot /= (double)hidden;
        total = layer ? total / (double)hidden : 0.0;
      }

      for (i = 0; i < hidden; ++i) {
        double dh = r.dh_out ? ltx_load_double(r.dh_out, t, i) : 0.0;
        if (r.dout) {
          const double g = ltx_load_double(r.dout, t, i);
          const double yhat = normalized(a, &r, i, mean, rstd);
          const double dn = g * scale_factor(a, &r, i);
          const double w = vector_at(&a->weight, i, 1.0);
          const double n = yhat * w + vector_at(&a->bias, i, 0.0);
          dh += rstd * (dn * w - total - yhat * dot);
          accumulate(sum_rows[0], sum_dtype, i, g * n);
          accumulate(sum_rows[1], sum_dtype, i, g);
          accumulate(sum_rows[3], sum_dtype, i, dn * yhat);
          accumulate(sum_rows[4], sum_dtype, i, dn);
          if (r.dscale) ltx_store_double(r.dscale, a->dscale.dtype, i, g * n);
        }
        if (r.dx) ltx_store_double(r.dx, t, i, dh);
        if (r.dy)
          ltx_store_double(r.dy, t, i,
                           r.gate ? dh * ltx_load_double(r.gate, a->gate.dtype, i) : dh);
        if (r.y) {
          const double dgate = dh * ltx_load_double(r.y, t, i);
          accumulate(sum_rows[2], sum_dtype, i, dgate);
          if (r.dgate) ltx_store_double(r.dgate, a->dgate.dtype, i, dgate);
        }
      }
    }
  }
  return LTX_OK;
}
