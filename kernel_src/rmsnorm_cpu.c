/* RMSNorm over the last dimension (portable C, the CPU backend), with the rounding points of
 * ltx_rmsnorm_cuda (see ltx_kernels.h). The sum of squares is accumulated in double; the
 * elementwise math is double rounded to fp32 where the CUDA kernel computes in fp32 (exactly its
 * fp32 results: double holds a product of two floats exactly), kept in double for a float64 x. */
#include "cpu_utils.h"

int ltx_rmsnorm_cpu(ltx_rows_t out, ltx_rows_t x, const void* weight, ltx_dtype_t weight_dtype,
                    int64_t hidden, float eps, int64_t row_begin, int64_t row_end) {
  const ltx_dtype_t t = x.dtype;
  const int status = ltx_cpu_status(ltx_check_rmsnorm(&out, &x, weight, weight_dtype, hidden, eps),
                                    row_begin, row_end, ltx_num_rows(&x));
  /* diffusers' RMSNorm rounds y to a fp16/bf16 weight's dtype before the product */
  const int round_y = weight && weight_dtype != LTX_FLOAT32 && weight_dtype != LTX_FLOAT64;
  int64_t row, i;
  if (status != LTX_OK || hidden == 0) return status;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    void* out_row = ltx_row_ptr(&out, row);
    double sumsq = 0.0, rstd;
    for (i = 0; i < hidden; ++i) {
      const double v = ltx_load_double(x_row, t, i);
      sumsq += v * v;
    }
    rstd = ltx_compute_precision(t, 1.0 / sqrt(sumsq / (double)hidden + (double)eps));
    for (i = 0; i < hidden; ++i) {
      const double y = ltx_compute_precision(t, ltx_load_double(x_row, t, i) * rstd);
      double result = y;
      if (weight)
        result = (round_y ? ltx_round_double(weight_dtype, y) : y) *
                 ltx_load_double(weight, weight_dtype, i);
      ltx_store_double(out_row, out.dtype, i, result);
    }
  }
  return LTX_OK;
}
