/* Gated residual (portable C, the CPU backend) with the rounding points of
 * ltx_gated_residual_cuda (see ltx_kernels.h): out = round_T(x + R(y * gate)), or
 * round_T(x + y) without gate, elementwise in double rounded to fp32 where the CUDA kernel
 * computes in fp32 (exactly its results), kept in double for a float64 x. */
#include "cpu_utils.h"

int ltx_gated_residual_cpu(ltx_rows_t out, ltx_rows_t x, ltx_rows_t y, ltx_rows_t gate,
                           int64_t hidden, int upcast, int64_t row_begin, int64_t row_end) {
  const ltx_dtype_t act = x.dtype; /* T */
  const int has_gate = gate.data != NULL;
  const int status = ltx_cpu_status(ltx_check_gated_residual(&out, &x, &y, &gate, hidden, upcast),
                                    row_begin, row_end, ltx_num_rows(&x));
  int64_t row, i;
  if (status != LTX_OK || hidden == 0) return status;

  for (row = row_begin; row < row_end; ++row) {
    const void* x_row = ltx_row_ptr(&x, row);
    const void* y_row = ltx_row_ptr(&y, row);
    const void* gate_row = has_gate ? ltx_row_ptr(&gate, row) : NULL;
    void* out_row = ltx_row_ptr(&out, row);
    for (i = 0; i < hidden; ++i) {
      double update = ltx_load_double(y_row, act, i);
      if (has_gate) {
        update *= ltx_load_double(gate_row, gate.dtype, i);
        update = upcast ? ltx_compute_precision(act, update) : ltx_round_double(act, update);
      }
      ltx_store_double(out_row, act, i, ltx_load_double(x_row, act, i) + update);
    }
  }
  return LTX_OK;
}
