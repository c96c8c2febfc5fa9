/* Rowwise FP8 quantization, optionally of GELU (portable C, the CPU backend), with the rule of
 * ltx_quantize_fp8_cuda (ltx_kernels.h): v = x or round_T(gelu(x)) as ltx_gelu_cpu computes it,
 * the row's amax and scale, then v times 448 / amax rounded to e4m3. v is recomputed in the second
 * pass. */
#include "cpu_utils.h"

static float activated(const void* row, ltx_dtype_t t, int64_t i, ltx_activation_t activation) {
  const float x = ltx_load(row, t, i);
  if (activation == LTX_ACTIVATION_NONE) return x;
  return (float)ltx_round_double(
      t, ltx_gelu_double(x, activation == LTX_ACTIVATION_GELU_TANH ? LTX_GELU_TANH : LTX_GELU_NONE,
                         0));
}

int ltx_quantize_fp8_cpu(ltx_rows_t out, float* out_scale, ltx_rows_t x, int64_t hidden,
                         ltx_activation_t activation, int64_t row_begin, int64_t row_end) {
  const int status = ltx_cpu_status(ltx_check_quantize_fp8(&out, out_scale, &x, hidden, activation),
                                    row_begin, row_end, ltx_num_rows(&x));
  int64_t row, i;
  if (status != LTX_OK) return status;
  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    uint8_t* out_row = (uint8_t*)ltx_row_ptr(&out, row);
    float amax = 0.f, factor;
    for (i = 0; i < hidden; ++i)
      amax = ltx_amax_step(amax, activated(x_row, x.dtype, i, activation));
    factor = ltx_fp8_factor(amax, &out_scale[row]);
    for (i = 0; i < hidden; ++i)
      out_row[i] = ltx_float_to_e4m3(activated(x_row, x.dtype, i, activation) * factor);
  }
  return LTX_OK;
}
