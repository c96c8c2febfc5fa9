/* RMSNorm over the last dimension (portable C, the CPU backend), with the rounding points of
 * ltx_rmsnorm_cuda (see ltx_kernels.h). The sum of squares is accumulated in double. */
#include "cpu_utils.h"

int ltx_rmsnorm_cpu(ltx_rows_t out, ltx_rows_t x, const void* weight, ltx_dtype_t weight_dtype,
                    int64_t hidden, float eps, int64_t row_begin, int64_t row_end) {
  const int status = ltx_cpu_status(ltx_check_rmsnorm(&out, &x, weight, weight_dtype, hidden, eps),
                                    row_begin, row_end, ltx_num_rows(&x));
  int64_t row, i;
  if (status != LTX_OK || hidden == 0) return status;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    void* out_row = ltx_row_ptr(&out, row);
    double sumsq = 0.0;
    float rstd;
    for (i = 0; i < hidden; ++i) {
      const double v = ltx_load(x_row, x.dtype, i);
      sumsq += v * v;
    }
    rstd = (float)(1.0 / sqrt(sumsq / (double)hidden + (double)eps));
    for (i = 0; i < hidden; ++i) {
      const float y = ltx_load(x_row, x.dtype, i) * rstd;
      float result = y;
      if (weight) {
        const float w = ltx_load(weight, weight_dtype, i);
        result = (weight_dtype == LTX_FLOAT32 ? y : ltx_round_to(weight_dtype, y)) * w;
      }
      ltx_store(out_row, out.dtype, i, result);
    }
  }
  return LTX_OK;
}
