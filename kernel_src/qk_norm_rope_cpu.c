/* RMSNorm and/or rotary embedding of q/k rows (portable C, the CPU backend), with the rounding
 * points of ltx_qk_norm_rope_cuda (see ltx_kernels.h). A row holds `heads` heads of `head_dim`
 * contiguous elements; the norm spans the whole row (sum of squares accumulated in double), the
 * rotation is per head with that head's cos/sin row, from the normalized values rounded to T.
 * Elementwise math in double, each operation rounded to fp32 where the CUDA kernel computes in
 * fp32 (exactly its results), kept in double for float64 tensors. Each rotation pair is read
 * before it is written, so out may alias x. With a quant format, tensor 0's out holds each head's
 * values (rounded to T) quantized by ltx_quantize_row, one scale per head (recomputed in its two
 * passes). */
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

/* One row of a tensor as the element functions below read it. */
typedef struct rope_row {
  const ltx_qk_norm_rope_args_t* a;
  const ltx_rope_tensor_t* t;
  ltx_dtype_t act, table; /* T, cos/sin dtype */
  const void *x_row, *cos_row, *sin_row;
  double rstd;
  int64_t head; /* the head ltx_quantize_row quantizes (quantized_element's ctx) */
} rope_row_t;

/* Element i of the row normalized and rounded to T (not rotated). */
static double rounded_element(const rope_row_t* r, int64_t i) {
  return ltx_round_double(
      r->act, normalized_element(r->x_row, r->act, &r->t->weight, r->a->normalize, r->rstd, i));
}

/* Rotary pair i of head `head`: its elements' offsets lo and hi in the row and their rotated
 * values before the rounding to T. */
static void rotated_pair(const rope_row_t* r, int64_t head, int64_t i, int64_t* lo, int64_t* hi,
                         double* o_lo, double* o_hi) {
  const ltx_qk_norm_rope_args_t* a = r->a;
  /* Head `head` starts at element `base` of the row; its cos/sin values start at elements
   * cos_base/sin_base of the row's cos/sin rows. */
  const int64_t base = head * a->head_dim, half = a->head_dim / 2;
  const int64_t cos_base = head * r->t->cos_head_stride, sin_base = head * r->t->sin_head_stride;
  const int64_t hi_table = a->rot_dim == a->head_dim ? (a->interleaved ? 2 * i + 1 : i + half) : i;
  double v_lo, v_hi;
  *lo = base + (a->interleaved ? 2 * i : i);
  *hi = base + (a->interleaved ? 2 * i + 1 : i + half);
  /* v rounded to T (a no-op without normalization: x already is T) */
  v_lo = rounded_element(r, *lo);
  v_hi = rounded_element(r, *hi);
  *o_lo = rotated(r->act, v_lo, ltx_load_double(r->cos_row, r->table, cos_base + *lo - base), -v_hi,
                  ltx_load_double(r->sin_row, r->table, sin_base + *lo - base));
  *o_hi = rotated(r->act, v_hi, ltx_load_double(r->cos_row, r->table, cos_base + hi_table), v_lo,
                  ltx_load_double(r->sin_row, r->table, sin_base + hi_table));
}

/* Element i of head r->head of the output, rounded to T (ltx_quantize_row's value). */
static float quantized_element(const void* ctx, int64_t i) {
  const rope_row_t* r = (const rope_row_t*)ctx;
  const int64_t half = r->a->head_dim / 2;
  int64_t lo, hi;
  double o_lo, o_hi;
  if (!r->cos_row) return (float)rounded_element(r, r->head * r->a->head_dim + i);
  if (r->a->interleaved)
    rotated_pair(r, r->head, i / 2, &lo, &hi, &o_lo, &o_hi);
  else
    rotated_pair(r, r->head, i % half, &lo, &hi, &o_lo, &o_hi);
  return (float)ltx_round_double(r->act, (r->a->interleaved ? i % 2 : i >= half) ? o_hi : o_lo);
}

int ltx_qk_norm_rope_cpu(const ltx_qk_norm_rope_args_t* args, int tensor, int64_t row_begin,
                         int64_t row_end) {
  const ltx_qk_norm_rope_args_t* a = args;
  const ltx_check_t check = ltx_check_qk_norm_rope(a);
  const ltx_rope_tensor_t* t;
  rope_row_t r;
  int64_t row_length, half, row, head, i;
  int status, quantized;
  if (check.status != LTX_OK) return check.status;
  if (tensor < 0 || tensor >= a->num_tensors) return LTX_ERR_INVALID_ARGUMENT;
  t = &a->tensors[tensor];
  status = ltx_cpu_status(check, row_begin, row_end, ltx_num_rows(&t->x));
  row_length = a->heads * a->head_dim;
  if (status != LTX_OK || row_length == 0) return status;
  r.a = a;
  r.t = t;
  r.act = a->tensors[0].x.dtype; /* T, shared by both tensors */
  r.table = t->cos.dtype;
  quantized = tensor == 0 && a->quant.format != LTX_QUANT_NONE;
  half = a->head_dim / 2;

  for (row = row_begin; row < row_end; ++row) {
    void* out_row = ltx_row_ptr(&t->out, row);
    r.x_row = ltx_row_ptr(&t->x, row);
    r.cos_row = t->cos.data ? ltx_row_ptr(&t->cos, row) : NULL;
    r.sin_row = t->sin.data ? ltx_row_ptr(&t->sin, row) : NULL;
    r.rstd = 0.0;
    if (a->normalize) {
      double sumsq = 0.0;
      for (i = 0; i < row_length; ++i) {
        const double v = ltx_load_double(r.x_row, r.act, i);
        sumsq += v * v;
      }
      r.rstd =
          ltx_compute_precision(r.act, 1.0 / sqrt(sumsq / (double)row_length + (double)a->eps));
    }
    if (quantized) { /* each head quantized: one scale per (row, head) */
      for (r.head = 0; r.head < a->heads; ++r.head)
        ltx_quantize_row(&a->quant, row * a->heads + r.head,
                         (int8_t*)out_row + r.head * a->head_dim, a->head_dim, quantized_element,
                         &r);
      continue;
    }
    if (!r.cos_row) { /* norm only (or a copy): one rounding to T */
      for (i = 0; i < row_length; ++i)
        ltx_store_double(out_row, r.act, i,
                         normalized_element(r.x_row, r.act, &t->weight, a->normalize, r.rstd, i));
      continue;
    }
    for (head = 0; head < a->heads; ++head) {
      for (i = 0; i < half; ++i) {
        int64_t lo, hi;
        double o_lo, o_hi;
        rotated_pair(&r, head, i, &lo, &hi, &o_lo, &o_hi);
        ltx_store_double(out_row, r.act, lo, o_lo);
        ltx_store_double(out_row, r.act, hi, o_hi);
      }
    }
  }
  return LTX_OK;
}
