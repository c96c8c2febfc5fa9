/* Gated residual (portable C, the CPU backend) with the rounding points of
 * ltx_gated_residual_cuda (see ltx_kernels.h): out = round_T(x + R(y * gate)), or
 * round_T(x + y) without gate, elementwise in fp32. */
#include "cpu_utils.h"

int ltx_gated_residual_cpu(ltx_rows_t out, ltx_rows_t x, ltx_rows_t y, ltx_rows_t gate,
                           int64_t hidden, int upcast, int64_t row_begin, int64_t row_end) {
  const ltx_dtype_t act = x.dtype; /* T */
  const int has_gate = gate.data != NULL;
  int64_t rows, row, i;
  if (!ltx_valid_dtype(act) || (has_gate && !ltx_valid_dtype(gate.dtype)))
    return LTX_ERR_UNSUPPORTED_DTYPE;
  /* x, y, out: T; the gate is T, or fp32 when the product is kept in fp32 (upcast). */
  if (out.dtype != act || y.dtype != act || (upcast != 0 && upcast != 1) ||
      (has_gate && gate.dtype != act && !(upcast && gate.dtype == LTX_FLOAT32)))
    return LTX_ERR_INVALID_ARGUMENT;
  rows = ltx_num_rows(&x);
  if (!ltx_valid_rows(&x) || !ltx_valid_rows(&out) || !ltx_valid_rows(&y) ||
      ltx_num_rows(&out) != rows || ltx_num_rows(&y) != rows ||
      !ltx_valid_optional_rows(&gate, rows) || hidden < 0 || row_begin < 0 || row_end > rows)
    return LTX_ERR_INVALID_ARGUMENT;
  if (hidden == 0) return LTX_OK;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    const void* y_row = ltx_row_ptr(&y, row);
    const void* gate_row = has_gate ? ltx_row_ptr(&gate, row) : NULL;
    void* out_row = ltx_row_ptr(&out, row);
    for (i = 0; i < hidden; ++i) {
      float update = ltx_load(y_row, act, i);
      if (has_gate) {
        update *= ltx_load(gate_row, gate.dtype, i);
        if (!upcast) update = ltx_round_to(act, update);
      }
      ltx_store(out_row, act, i, ltx_load(x_row, act, i) + update);
    }
  }
  return LTX_OK;
}
