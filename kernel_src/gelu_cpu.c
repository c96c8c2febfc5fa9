/* GELU and GEGLU and their backward (portable C, the CPU backend), with the rounding points of
 * ltx_gelu_cuda and ltx_gelu_backward_cuda (see ltx_kernels.h). gelu and gelu' are evaluated in
 * double and rounded to fp32 where the CUDA kernels compute in fp32 (float64 tensors: kept in
 * double, for gradcheck); the forms have no cancellation for negative x:
 *   tanh:  gelu(x) = x s(t),  s(t) = 1 / (1 + exp(-t)),  t = 2 sqrt(2/pi) (x + 0.044715 x^3)
 *          gelu'(x) = s(t) + x s(t) s(-t) dt/dx
 *   erf:   gelu(x) = x Phi(x),  Phi(x) = 0.5 erfc(-x / sqrt(2));  gelu'(x) = Phi(x) + x phi(x) */
#include "cpu_utils.h"

int ltx_gelu_cpu(ltx_rows_t out, ltx_rows_t x, int64_t hidden, ltx_gelu_approximate_t approximate,
                 int gated, int64_t row_begin, int64_t row_end) {
  const ltx_dtype_t t = x.dtype;
  const int status = ltx_cpu_status(ltx_check_gelu(&out, &x, hidden, approximate, gated), row_begin,
                                    row_end, ltx_num_rows(&x));
  int64_t row, i;
  if (status != LTX_OK || hidden == 0) return status;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    void* out_row = ltx_row_ptr(&out, row);
    for (i = 0; i < hidden; ++i) {
      if (!gated) {
        ltx_store_double(out_row, t, i,
                         ltx_gelu_double(ltx_load_double(x_row, t, i), approximate, 0));
        continue;
      }
      /* GEGLU: the row holds [h | g], out = round_T(h * round_T(gelu(g))); the product of two
       * values of T is exact in double, so storing it rounds as the fp32 product does. */
      {
        const double g = ltx_load_double(x_row, t, hidden + i);
        const double gelu_g = ltx_round_double(t, ltx_gelu_double(g, approximate, 0));
        ltx_store_double(out_row, t, i, ltx_load_double(x_row, t, i) * gelu_g);
      }
    }
  }
  return LTX_OK;
}

int ltx_gelu_backward_cpu(ltx_rows_t dx, ltx_rows_t dout, ltx_rows_t x, int64_t hidden,
                          ltx_gelu_approximate_t approximate, int gated, int64_t row_begin,
                          int64_t row_end) {
  const ltx_dtype_t t = x.dtype;
  const int status =
      ltx_cpu_status(ltx_check_gelu_backward(&dx, &dout, &x, hidden, approximate, gated), row_begin,
                     row_end, ltx_num_rows(&x));
  int64_t row, i;
  if (status != LTX_OK || hidden == 0) return status;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    const void* dout_row = ltx_row_ptr(&dout, row);
    void* dx_row = ltx_row_ptr(&dx, row);
    for (i = 0; i < hidden; ++i) {
      const double d = ltx_load_double(dout_row, t, i);
      if (!gated) {
        const double slope =
            ltx_compute_precision(t, ltx_gelu_double(ltx_load_double(x_row, t, i), approximate, 1));
        ltx_store_double(dx_row, t, i, d * slope);
        continue;
      }
      /* GEGLU: dh = round_T(dout * round_T(gelu(g))), dg = round_T(gelu'(g) * round_T(dout * h)).
       */
      {
        const double h = ltx_load_double(x_row, t, i), g = ltx_load_double(x_row, t, hidden + i);
        const double gelu_g = ltx_round_double(t, ltx_gelu_double(g, approximate, 0));
        const double slope = ltx_compute_precision(t, ltx_gelu_double(g, approximate, 1));
        ltx_store_double(dx_row, t, i, d * gelu_g);
        ltx_store_double(dx_row, t, hidden + i, slope * ltx_round_double(t, d * h));
      }
    }
  }
  return LTX_OK;
}
