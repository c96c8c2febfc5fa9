/*
 * Dtype and row helpers shared by the argument checks, the C implementations and the CUDA
 * launchers (plain C11, header only): dtype validity and size, row counts, validity and
 * alignment of ltx_rows_t.
 */
#ifndef LTX_ROWS_H_
#define LTX_ROWS_H_

#include <stddef.h>
#include <stdint.h>

#include "ltx_kernels.h"

/* The dtypes of the models: float32, float16, bfloat16. */
static inline int ltx_model_dtype(ltx_dtype_t dtype) {
  return dtype == LTX_FLOAT32 || dtype == LTX_FLOAT16 || dtype == LTX_BFLOAT16;
}

static inline int ltx_valid_dtype(ltx_dtype_t dtype) {
  return ltx_model_dtype(dtype) || dtype == LTX_FLOAT64 || dtype == LTX_FLOAT8_E4M3 ||
         dtype == LTX_INT8;
}

static inline int ltx_dtype_size(ltx_dtype_t dtype) {
  switch (dtype) {
    case LTX_FLOAT64:
    case LTX_INT64: return 8;
    case LTX_FLOAT32:
    case LTX_INT32: return 4;
    case LTX_FLOAT8_E4M3:
    case LTX_INT8: return 1;
    default: return 2;
  }
}

static inline int64_t ltx_num_rows(const ltx_rows_t* r) {
  return r->size[0] * r->size[1] * r->size[2];
}

/* Non-negative sizes, a valid dtype, and data unless there are no rows. */
static inline int ltx_valid_rows(const ltx_rows_t* r) {
  int d;
  for (d = 0; d < LTX_MAX_ROW_DIMS; ++d)
    if (r->size[d] < 0) return 0;
  return ltx_valid_dtype(r->dtype) && (r->data != NULL || ltx_num_rows(r) == 0);
}

/* True when an optional row operand is absent (data NULL) or describes `rows` valid rows. */
static inline int ltx_valid_optional_rows(const ltx_rows_t* r, int64_t rows) {
  return r->data == NULL || (ltx_valid_rows(r) && ltx_num_rows(r) == rows);
}

/* True when every row start of r is aligned to `alignment` bytes (elements of elem_bytes). */
static inline int ltx_rows_aligned(const ltx_rows_t* r, int elem_bytes, int alignment) {
  int d;
  if ((uintptr_t)r->data % (uintptr_t)alignment != 0) return 0;
  for (d = 0; d < LTX_MAX_ROW_DIMS; ++d)
    if (r->size[d] > 1 && (r->stride[d] * elem_bytes) % alignment != 0) return 0;
  return 1;
}

#endif /* LTX_ROWS_H_ */
