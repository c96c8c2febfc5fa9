/*
 * ltx_kernels C API: the launchers of every op, for CUDA and for the CPU.
 *
 * No torch headers, no CUDA headers: plain C, so the CPU implementations compile with any C11
 * compiler and any host code can call the CUDA launchers with raw pointers.
 *
 * Conventions shared by every op
 * - Activations are matrices of `rows` x `hidden` elements whose last dimension is contiguous.
 *   Rows need not be evenly spaced: a ltx_rows_t gives each row's element offset as a mixed-radix
 *   index over up to three leading dimensions (so [B, S, D] views with any strides, and chunks of a
 *   larger buffer, are addressed without copies). All offsets are 64-bit.
 * - Outputs are written, never read; inputs are read, never written.
 * - Launchers return LTX_OK (0), a negative LTX_ERR_* for a bad argument, or, for CUDA launchers,
 *   the positive cudaError_t of a failed launch. They never synchronize and never allocate.
 */
#ifndef LTX_KERNELS_H_
#define LTX_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. */
typedef enum ltx_dtype {
  LTX_FLOAT32 = 0,
  LTX_FLOAT16 = 1,
  LTX_BFLOAT16 = 2,
} ltx_dtype_t;

/* Status codes (CUDA launchers may also return a positive cudaError_t). */
#define LTX_OK 0
#define LTX_ERR_INVALID_ARGUMENT (-1)
#define LTX_ERR_UNSUPPORTED_DTYPE (-2)

/* Same type as cudaStream_t, declared without the CUDA headers. */
typedef struct CUstream_st* ltx_stream_t;

#define LTX_MAX_ROW_DIMS 3

/*
 * How the rows of a [rows, hidden] matrix sit in memory. Row r is split as a mixed-radix number
 * r = (i0 * size[1] + i1) * size[2] + i2 and starts at element i0*stride[0] + i1*stride[1] +
 * i2*stride[2] of `data`; unused leading dims have size 1. rows = size[0]*size[1]*size[2].
 */
typedef struct ltx_rows {
  void* data;
  ltx_dtype_t dtype;
  int64_t size[LTX_MAX_ROW_DIMS];
  int64_t stride[LTX_MAX_ROW_DIMS];
} ltx_rows_t;

/*
 * RMSNorm over the last dim, rounding as diffusers' RMSNorm does:
 *   y = float(x) * rsqrt(mean(float(x)^2) + eps)                     (fp32 accumulation)
 *   no weight:        out = round_to(x.dtype, y)
 *   fp16/bf16 weight: out = round_to(w.dtype, round_to(w.dtype, y) * w)
 *   fp32 weight:      out = y * w                                    (fp32 output)
 * out.dtype must be x.dtype without a weight and weight.dtype with one. `weight` (contiguous,
 * `hidden` elements) may be NULL. x and out must describe the same number of rows.
 */
int ltx_rmsnorm_cuda(ltx_rows_t out, ltx_rows_t x, const void* weight, ltx_dtype_t weight_dtype,
                     int64_t hidden, float eps, ltx_stream_t stream);

/* CPU implementation of ltx_rmsnorm_cuda, over rows [row_begin, row_end) only (so a caller can
 * split the rows across threads). */
int ltx_rmsnorm_cpu(ltx_rows_t out, ltx_rows_t x, const void* weight, ltx_dtype_t weight_dtype,
                    int64_t hidden, float eps, int64_t row_begin, int64_t row_end);

#ifdef __cplusplus
}
#endif

#endif /* LTX_KERNELS_H_ */
