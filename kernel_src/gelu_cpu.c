/* GELU and GEGLU (portable C, the CPU backend), with the rounding points of ltx_gelu_cuda (see
 * ltx_kernels.h). gelu is evaluated in double and rounded to fp32, so it is the correctly rounded
 * fp32 value up to a double rounding; it uses forms without cancellation for negative x:
 *   tanh:  0.5 x (1 + tanh(z)) = x / (1 + exp(-2z)),  z = sqrt(2/pi) (x + 0.044715 x^3)
 *   erf:   0.5 x (1 + erf(x / sqrt(2))) = 0.5 x erfc(-x / sqrt(2)) */
#include "cpu_utils.h"

/* gelu(x) in double, rounded to fp32. */
static float gelu_value(float x, ltx_gelu_approximate_t approximate) {
  const double v = x;
  if (approximate == LTX_GELU_TANH) {
    const double z = 0.79788456080286535588 * (v + 0.044715 * v * v * v); /* sqrt(2/pi) */
    return (float)(v / (1.0 + exp(-2.0 * z)));
  }
  return (float)(0.5 * v * erfc(-v * 0.70710678118654752440)); /* 1/sqrt(2) */
}

int ltx_gelu_cpu(ltx_rows_t out, ltx_rows_t x, int64_t hidden, ltx_gelu_approximate_t approximate,
                 int gated, int64_t row_begin, int64_t row_end) {
  const ltx_dtype_t act = x.dtype; /* T */
  const int status = ltx_cpu_status(ltx_check_gelu(&out, &x, hidden, approximate, gated), row_begin,
                                    row_end, ltx_num_rows(&x));
  int64_t row, i;
  if (status != LTX_OK || hidden == 0) return status;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    void* out_row = ltx_row_ptr(&out, row);
    if (!gated) {
      for (i = 0; i < hidden; ++i)
        ltx_store(out_row, act, i, gelu_value(ltx_load(x_row, act, i), approximate));
      continue;
    }
    /* GEGLU: the row holds [hidden | gate], out = round_T(hidden * round_T(gelu(gate))). */
    for (i = 0; i < hidden; ++i) {
      const float g = ltx_round_to(act, gelu_value(ltx_load(x_row, act, hidden + i), approximate));
      ltx_store(out_row, act, i, ltx_load(x_row, act, i) * g);
    }
  }
  return LTX_OK;
}
