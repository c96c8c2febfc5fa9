/* RMSNorm over the last dimension (portable C, the CPU backend), with the rounding points of
 * ltx_rmsnorm_cuda (see ltx_kernels.h). The sum of squares is accumulated in double. */
#include "cpu_utils.h"

int ltx_rmsnorm_cpu(ltx_rows_t out, ltx_rows_t x, const void* weight, ltx_dtype_t weight_dtype,
                    int64_t hidden, float eps, int64_t row_begin, int64_t row_end) {
  int64_t row, i;
  if (!ltx_valid_rows(&out) || !ltx_valid_rows(&x) || ltx_num_rows(&out) != ltx_num_rows(&x) ||
      hidden < 0 || !(eps >= 0.f) || row_begin < 0 || row_end > ltx_num_rows(&x))
    return LTX_ERR_INVALID_ARGUMENT;
  if (weight && !ltx_valid_dtype(weight_dtype)) return LTX_ERR_UNSUPPORTED_DTYPE;
  if (out.dtype != (weight ? weight_dtype : x.dtype)) return LTX_ERR_INVALID_ARGUMENT;
  if (hidden == 0) return LTX_OK;

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
