/* Row quantization, optionally of GELU (portable C, the CPU backend), with the rule of
 * ltx_quantize_cuda (ltx_kernels.h): v = x or round_T(gelu(x)) as ltx_gelu_cpu computes it, then
 * the row quantized by ltx_quantize_row (v computed in both of its passes). */
#include "cpu_utils.h"

/* A row of x and how it is activated (ltx_quantize_row's ctx). */
typedef struct activated_row {
  const void* x;
  ltx_dtype_t dtype;
  ltx_activation_t activation;
  ltx_gelu_approximate_t approximate;
} activated_row_t;

static float activated(const void* ctx, int64_t i) {
  const activated_row_t* r = (const activated_row_t*)ctx;
  const float x = ltx_load(r->x, r->dtype, i);
  if (r->activation == LTX_ACTIVATION_NONE) return x;
  return (float)ltx_round_double(r->dtype, ltx_gelu_double(x, r->approximate, 0));
}

int ltx_quantize_cpu(ltx_rows_t out, ltx_quant_t quant, ltx_rows_t x, int64_t hidden,
                     ltx_activation_t activation, ltx_gelu_approximate_t approximate,
                     int64_t row_begin, int64_t row_end) {
  const int status =
      ltx_cpu_status(ltx_check_quantize(&out, &quant, &x, hidden, activation, approximate),
                     row_begin, row_end, ltx_num_rows(&x));
  int64_t row;
  if (status != LTX_OK) return status;
  for (row = row_begin; row < row_end; ++row) {
    const activated_row_t r = {ltx_row_ptr(&x, row), x.dtype, activation, approximate};
    ltx_quantize_row(&quant, row, ltx_row_ptr(&out, row), hidden, activated, &r);
  }
  return LTX_OK;
}
