/* (Residual +) RMSNorm/LayerNorm + AdaLN modulation over the last dimension (portable C, the CPU
 * backend), with the rounding points of ltx_norm_modulate_cuda (see ltx_kernels.h). Elementwise
 * math in double, each operation rounded to fp32 where the CUDA kernel computes in fp32 (exactly
 * its fp32 results: double rounding of a sum or product of two floats is innocuous) and kept in
 * double for a float64 x; the sum of squares, the mean and the variance are accumulated in double
 * (LayerNorm in two passes: mean, then mean of squared deviations). The row h is recomputed from
 * x, y, gate in every pass (nothing is allocated), and outputs are written in the last pass only.
 * A quantized out takes one more pass: the row's amax, then the quantized values. */
#include "cpu_utils.h"

/* The rows of one call's operands: row pointers of the present row operands (NULL when absent). */
typedef struct norm_modulate_row {
  const void *x, *y, *gate, *scale, *shift;
  void *out, *residual_out;
} norm_modulate_row_t;

/* v as the kernel computes it for T = x.dtype: rounded to fp32, or kept in double for float64. */
static double computed(const ltx_norm_modulate_args_t* a, double v) {
  return ltx_compute_precision(a->x.dtype, v);
}

/* R(v): v rounded to T when upcast is 0, else as computed. */
static double rounded_unless_upcast(const ltx_norm_modulate_args_t* a, double v) {
  return a->upcast ? computed(a, v) : ltx_round_double(a->x.dtype, v);
}

/* Element i of h = x, or round_T(x + R(y * gate)), or round_T(x + y). */
static double residual_element(const ltx_norm_modulate_args_t* a, const norm_modulate_row_t* r,
                               int64_t i) {
  const ltx_dtype_t act = a->x.dtype;
  const double x = ltx_load_double(r->x, act, i);
  double update;
  if (!r->y) return x;
  update = ltx_load_double(r->y, act, i);
  if (r->gate)
    update = rounded_unless_upcast(a, update * ltx_load_double(r->gate, a->gate.dtype, i));
  return ltx_round_double(act, x + update);
}

/* Element i of out: the norm of h (statistics mean, rstd, each as computed), then the modulation,
 * rounded as ltx_kernels.h says (the value stored, or quantized for a quantized out). */
static double modulated_element(const ltx_norm_modulate_args_t* a, const norm_modulate_row_t* r,
                                int64_t i, double mean, double rstd, ltx_dtype_t modulation_dtype) {
  const ltx_dtype_t act = a->x.dtype;
  const double h = residual_element(a, r, i);
  double n;
  if (a->norm == LTX_NORM_RMS) {
    /* diffusers RMSNorm: n = R(R(y) * w), or R(y); upcast: y * w as computed. */
    n = rounded_unless_upcast(a, h * rstd);
    if (a->weight.data)
      n = rounded_unless_upcast(a, n * ltx_load_double(a->weight.data, a->weight.dtype, i));
  } else {
    /* F.layer_norm: n = R((h - mean) * rstd * w + b), one rounding. */
    n = computed(a, computed(a, h - mean) * rstd);
    if (a->weight.data) n = computed(a, n * ltx_load_double(a->weight.data, a->weight.dtype, i));
    if (a->bias.data) n = computed(a, n + ltx_load_double(a->bias.data, a->bias.dtype, i));
    n = rounded_unless_upcast(a, n);
  }
  if (r->scale) {
    const double factor =
        rounded_unless_upcast(a, 1.0 + ltx_load_double(r->scale, modulation_dtype, i));
    n = rounded_unless_upcast(a, n * factor);
  }
  if (r->shift) n = computed(a, n + ltx_load_double(r->shift, modulation_dtype, i));
  return ltx_round_double(act, n); /* the value out holds (T) */
}

/* A row's state for the quantized-output epilogue (ltx_quantize_row's value and ctx). */
typedef struct quantized_row {
  const ltx_norm_modulate_args_t* a;
  const norm_modulate_row_t* r;
  double mean, rstd;
  ltx_dtype_t modulation_dtype;
} quantized_row_t;

static float quantized_value(const void* ctx, int64_t i) {
  const quantized_row_t* q = (const quantized_row_t*)ctx;
  return (float)modulated_element(q->a, q->r, i, q->mean, q->rstd, q->modulation_dtype);
}

int ltx_norm_modulate_cpu(const ltx_norm_modulate_args_t* args, int64_t row_begin,
                          int64_t row_end) {
  const ltx_norm_modulate_args_t* a = args;
  const int status =
      ltx_cpu_status(ltx_check_norm_modulate(a), row_begin, row_end, a ? ltx_num_rows(&a->x) : 0);
  ltx_dtype_t act, modulation_dtype;
  int has_y;
  int64_t row, i, hidden;
  if (status != LTX_OK || a->hidden == 0) return status;
  act = a->x.dtype; /* T */
  has_y = a->y.data != NULL;
  hidden = a->hidden;
  /* gate, scale and shift share one dtype (checked) */
  modulation_dtype = a->gate.data    ? a->gate.dtype
                     : a->scale.data ? a->scale.dtype
                     : a->shift.data ? a->shift.dtype
                                     : act;

  for (row = row_begin; row < row_end; ++row) {
    norm_modulate_row_t r;
    double mean = 0.0, sum = 0.0, rstd;
    r.x = ltx_row_ptr(&a->x, row);
    r.y = has_y ? ltx_row_ptr(&a->y, row) : NULL;
    r.gate = a->gate.data ? ltx_row_ptr(&a->gate, row) : NULL;
    r.scale = a->scale.data ? ltx_row_ptr(&a->scale, row) : NULL;
    r.shift = a->shift.data ? ltx_row_ptr(&a->shift, row) : NULL;
    r.out = ltx_row_ptr(&a->out, row);
    r.residual_out = a->residual_out.data ? ltx_row_ptr(&a->residual_out, row) : NULL;

    /* Statistics of h: RMS: sum of h^2; Layer: mean, then sum of (h - mean)^2. */
    if (a->norm == LTX_NORM_LAYER) {
      for (i = 0; i < hidden; ++i) mean += residual_element(a, &r, i);
      mean /= (double)hidden;
    }
    for (i = 0; i < hidden; ++i) {
      const double deviation = residual_element(a, &r, i) - mean;
      sum += deviation * deviation;
    }
    mean = computed(a, mean);
    rstd = computed(a, 1.0 / sqrt(sum / (double)hidden + (double)a->eps));

    if (a->quant.format != LTX_QUANT_NONE) {
      const quantized_row_t q = {a, &r, mean, rstd, modulation_dtype};
      ltx_quantize_row(&a->quant, row, r.out, hidden, quantized_value, &q);
    }
    for (i = 0; i < hidden; ++i) {
      if (r.residual_out) ltx_store_double(r.residual_out, act, i, residual_element(a, &r, i));
      if (a->quant.format == LTX_QUANT_NONE)
        ltx_store_double(r.out, act, i, modulated_element(a, &r, i, mean, rstd, modulation_dtype));
    }
  }
  return LTX_OK;
}
