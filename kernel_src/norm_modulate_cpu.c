/* (Residual +) RMSNorm/LayerNorm + AdaLN modulation over the last dimension (portable C, the CPU
 * backend), with the rounding points of ltx_norm_modulate_cuda (see ltx_kernels.h). Elementwise
 * math in fp32; the sum of squares, the mean and the variance are accumulated in double (LayerNorm
 * in two passes: mean, then mean of squared deviations). The row h is recomputed from x, y, gate
 * in every pass (nothing is allocated), and outputs are written in the last pass only. An FP8 out
 * takes one more pass: the row's amax, then the quantized values. */
#include "cpu_utils.h"

/* The rows of one call's operands: row pointers of the present row operands (NULL when absent). */
typedef struct norm_modulate_row {
  const void *x, *y, *gate, *scale, *shift;
  void *out, *residual_out;
} norm_modulate_row_t;

/* Element i of h = x, or round_T(x + R(y * gate)), or round_T(x + y). */
static float residual_element(const ltx_norm_modulate_args_t* a, const norm_modulate_row_t* r,
                              int64_t i) {
  const ltx_dtype_t act = a->x.dtype;
  float x = ltx_load(r->x, act, i), update;
  if (!r->y) return x;
  update = ltx_load(r->y, act, i);
  if (r->gate) {
    update *= ltx_load(r->gate, a->gate.dtype, i);
    if (!a->upcast) update = ltx_round_to(act, update);
  }
  return ltx_round_to(act, x + update);
}

/* Element i of out: the norm of h (statistics mean_f, rstd), then the modulation, rounded as
 * ltx_kernels.h says (the value stored, or quantized for an FP8 out). */
static float modulated_element(const ltx_norm_modulate_args_t* a, const norm_modulate_row_t* r,
                               int64_t i, float mean_f, float rstd, ltx_dtype_t modulation_dtype) {
  const ltx_dtype_t act = a->x.dtype;
  const int upcast = a->upcast != 0;
  const float h = residual_element(a, r, i);
  float n;
  if (a->norm == LTX_NORM_RMS) {
    /* diffusers RMSNorm: n = R(R(y) * w), or R(y); upcast: y * w in fp32. */
    n = h * rstd;
    if (!upcast) n = ltx_round_to(act, n);
    if (a->weight.data) {
      n *= ltx_load(a->weight.data, a->weight.dtype, i);
      if (!upcast) n = ltx_round_to(act, n);
    }
  } else {
    /* F.layer_norm: n = R((h - mean) * rstd * w + b), one rounding. */
    n = (h - mean_f) * rstd;
    if (a->weight.data) n *= ltx_load(a->weight.data, a->weight.dtype, i);
    if (a->bias.data) n += ltx_load(a->bias.data, a->bias.dtype, i);
    if (!upcast) n = ltx_round_to(act, n);
  }
  if (r->scale) {
    float factor = 1.f + ltx_load(r->scale, modulation_dtype, i);
    if (!upcast) factor = ltx_round_to(act, factor);
    n *= factor;
    if (!upcast) n = ltx_round_to(act, n);
  }
  if (r->shift) n += ltx_load(r->shift, modulation_dtype, i);
  return ltx_round_to(act, n); /* the value out holds (T) */
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
    double mean = 0.0, sum = 0.0;
    float mean_f = 0.f, rstd;
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
      mean_f = (float)mean;
    }
    for (i = 0; i < hidden; ++i) {
      const double deviation = (double)residual_element(a, &r, i) - mean;
      sum += deviation * deviation;
    }
    rstd = (float)(1.0 / sqrt(sum / (double)hidden + (double)a->eps));

    if (a->out_scale) { /* FP8 out: the row's amax first, then n * 448 / amax rounded to e4m3 */
      float amax = 0.f, factor;
      for (i = 0; i < hidden; ++i)
        amax = ltx_amax_step(amax, modulated_element(a, &r, i, mean_f, rstd, modulation_dtype));
      factor = ltx_fp8_factor(amax, &a->out_scale[row]);
      for (i = 0; i < hidden; ++i)
        ((uint8_t*)r.out)[i] =
            ltx_float_to_e4m3(modulated_element(a, &r, i, mean_f, rstd, modulation_dtype) * factor);
    }
    for (i = 0; i < hidden; ++i) {
      if (r.residual_out) ltx_store(r.residual_out, act, i, residual_element(a, &r, i));
      if (!a->out_scale)
        ltx_store(r.out, act, i, modulated_element(a, &r, i, mean_f, rstd, modulation_dtype));
    }
  }
  return LTX_OK;
}
