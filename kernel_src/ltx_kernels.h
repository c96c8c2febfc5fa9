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

/* Element types. LTX_FLOAT64 only where an op says so, and only in its C twin (the CPU backend):
 * there it computes in double, so torch.autograd.gradcheck runs on the op's own code. */
typedef enum ltx_dtype {
  LTX_FLOAT32 = 0,
  LTX_FLOAT16 = 1,
  LTX_BFLOAT16 = 2,
  LTX_FLOAT64 = 3,
  LTX_FLOAT8_E4M3 = 4, /* float8_e4m3fn: only quantized outputs (below) */
  LTX_INT32 = 5,       /* int32 and int64: only index vectors (attention's key lengths) */
  LTX_INT64 = 6,
  LTX_INT8 = 7, /* int8: quantized outputs (LTX_QUANT_I8_ROW, attention's k codes), attention_int8's
                   q and k codes */
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
 * `hidden` elements) may be NULL. x and out must describe the same number of rows. The C twin also
 * takes x = LTX_FLOAT64 (computed in double), with a float64 weight.
 */
int ltx_rmsnorm_cuda(ltx_rows_t out, ltx_rows_t x, const void* weight, ltx_dtype_t weight_dtype,
                     int64_t hidden, float eps, ltx_stream_t stream);

/* CPU implementation of ltx_rmsnorm_cuda, over rows [row_begin, row_end) only (so a caller can
 * split the rows across threads). */
int ltx_rmsnorm_cpu(ltx_rows_t out, ltx_rows_t x, const void* weight, ltx_dtype_t weight_dtype,
                    int64_t hidden, float eps, int64_t row_begin, int64_t row_end);

/* An optional per-channel vector of `hidden` contiguous elements (data NULL: absent). */
typedef struct ltx_vector {
  const void* data;
  ltx_dtype_t dtype;
} ltx_vector_t;

/*
 * Rounding of the fused elementwise ops. Every fused op emulates a PyTorch expression; T is the
 * activation dtype (x.dtype) and R(v) rounds v to T when `upcast` is 0 and leaves it in fp32 when
 * `upcast` is 1. Products and sums are computed in fp32 from the (widened) operands.
 * - upcast = 0 emulates code that runs in the model dtype, where PyTorch rounds the result of
 *   every elementwise op to T (LTX-Video, FLUX, SD3, HunyuanVideo, CogVideoX). All operands then
 *   have dtype T.
 * - upcast = 1 emulates code that computes in fp32 and rounds once at the end (Wan:
 *   `(norm(x.float()) * (1 + scale) + shift).type_as(x)`). Modulation tensors, weights and biases
 *   may then be T or fp32.
 * Outputs (n, h, out) always have dtype T and are always rounded to T. Where an op's C twin takes
 * T = LTX_FLOAT64, it computes in double instead of fp32 (R and round_T are then exact).
 */

/*
 * Quantized outputs (inference). An op that emits quantized rows computes its value v (rounded to
 * T as its T-output form rounds it) for a whole row, then writes it in the format its ltx_quant_t
 * names: codes in `out`, scales in `quant.scale`, v ~= code * scale. The formats:
 * - LTX_QUANT_E4M3_ROW (torchao's rowwise rule), per row r of `hidden` elements:
 *     a        = max(max |v| over the row, LTX_QUANT_MIN_AMAX)  (NaN when the row holds one)
 *     out      = e4m3(fl32(v * fl32(LTX_E4M3_MAX / a))), to nearest even, saturated to +-448
 *     scale[r] = fl32(a / LTX_E4M3_MAX)                          (ltx_e4m3_row_factor)
 *   out dtype LTX_FLOAT8_E4M3, `scale` `rows` contiguous fp32 indexed by row number: the operands
 *   of a rowwise-scaled GEMM (torch._scaled_mm).
 * - LTX_QUANT_I8_ROW (symmetric INT8), per row r (rows of head_dim: attention's q, one scale per
 *   token and head):
 *     a        = max(max |v| over the row, LTX_QUANT_MIN_AMAX)  (NaN when the row holds one)
 *     out      = clamp(rint(fl32(v * fl32(LTX_I8_MAX / a))), -127, 127), ties to even (NaN: 0)
 *     scale[r] = fl32(a / LTX_I8_MAX)                            (ltx_i8_row_factor)
 *   out dtype LTX_INT8, `scale` as above.
 */
#define LTX_E4M3_MAX 448.0f
#define LTX_I8_MAX 127.0f
#define LTX_QUANT_MIN_AMAX 1e-12f

typedef enum ltx_quant_format {
  LTX_QUANT_NONE = 0,     /* not quantized: out has dtype T */
  LTX_QUANT_E4M3_ROW = 1, /* float8_e4m3fn codes, one fp32 scale per row */
  LTX_QUANT_I8_ROW = 2,   /* int8 codes, one fp32 scale per row */
} ltx_quant_format_t;

/* How an op's output is quantized. */
typedef struct ltx_quant {
  ltx_quant_format_t format;
  float* scale;  /* the scales ([rows] fp32 for the per-row formats); NULL with LTX_QUANT_NONE */
  int64_t group; /* elements per scale along a row: 0 for the per-row formats (the whole row) */
} ltx_quant_t;

#ifdef __CUDACC__
#define LTX_HOST_DEVICE __host__ __device__
#else
#define LTX_HOST_DEVICE
#endif

/* The scale rule of the symmetric formats for a row's amax and the format's largest code, for the
 * C twins and the CUDA kernels alike: sets *scale = a / code_max and returns the factor the row's
 * values are multiplied by before their rounding to codes, code_max / a. */
static inline LTX_HOST_DEVICE float ltx_row_factor(float amax, float code_max, float* scale) {
  const float a = amax > LTX_QUANT_MIN_AMAX || amax != amax ? amax : LTX_QUANT_MIN_AMAX;
  *scale = a / code_max;
  return code_max / a;
}

/* The LTX_QUANT_E4M3_ROW rule (code_max LTX_E4M3_MAX). */
static inline LTX_HOST_DEVICE float ltx_e4m3_row_factor(float amax, float* scale) {
  return ltx_row_factor(amax, LTX_E4M3_MAX, scale);
}

/* The LTX_QUANT_I8_ROW rule (code_max LTX_I8_MAX). */
static inline LTX_HOST_DEVICE float ltx_i8_row_factor(float amax, float* scale) {
  return ltx_row_factor(amax, LTX_I8_MAX, scale);
}

/* Normalization of the fused norm ops. */
typedef enum ltx_norm_kind {
  LTX_NORM_RMS = 0,   /* y = h * rsqrt(mean(h^2) + eps) */
  LTX_NORM_LAYER = 1, /* y = (h - mean(h)) * rsqrt(var(h) + eps), biased variance */
} ltx_norm_kind_t;

/*
 * (Residual +) norm + AdaLN modulation over the last dim, one pass:
 *   h   = x                                            (y absent)
 *   h   = round_T(x + R(y * gate))  or  round_T(x + y)  (y given; gate optional)
 *   y_  = normalized h (fp32, see ltx_norm_kind_t)
 *   RMS:   n = R(R(y_) * weight)  (diffusers RMSNorm: `.to(w.dtype) * w`), n = R(y_) without
 * weight; with upcast, n = y_ * weight in fp32. No bias. Layer: n = R(y_ * weight + bias)
 * (F.layer_norm rounds once; weight, bias optional). out = round_T(R(n * R(1 + scale)) + shift)
 * (scale, shift each optional) Row operands (x, y, gate, scale, shift, out, residual_out) are
 * described per row, so scale, shift and gate broadcast from [D], [B,1,D], [B,T,D] or strided chunk
 * views with stride-0 levels. residual_out (h) is written when y is given (its data may then be
 * NULL to skip it), never read. Dtypes: x, y, out, residual_out: T. upcast = 0: gate, scale, shift,
 * weight, bias are T too. upcast = 1: gate, scale and shift share one dtype, T or fp32; weight and
 * bias each T or fp32. With a quant format, out holds the quantized rows (Quantized outputs,
 * above) and quant.scale their scales. The C twin also takes T = LTX_FLOAT64 (computed in double)
 * when out is not quantized.
 */
typedef struct ltx_norm_modulate_args {
  ltx_rows_t out;          /* n after modulation */
  ltx_rows_t residual_out; /* h */
  ltx_rows_t x;
  ltx_rows_t y, gate, scale, shift; /* data NULL when absent */
  ltx_vector_t weight, bias;        /* data NULL when absent; bias only with LTX_NORM_LAYER */
  ltx_norm_kind_t norm;
  int64_t hidden;
  float eps;
  int upcast;
  ltx_quant_t quant; /* format LTX_QUANT_NONE: out has dtype T */
} ltx_norm_modulate_args_t;

int ltx_norm_modulate_cuda(const ltx_norm_modulate_args_t* args, ltx_stream_t stream);
int ltx_norm_modulate_cpu(const ltx_norm_modulate_args_t* args, int64_t row_begin, int64_t row_end);

/*
 * Backward of ltx_norm_modulate, and of ltx_rmsnorm and ltx_gated_residual, its special cases:
 * the gradients of the inputs for the gradients of the outputs, computed in fp32 as the
 * vector-Jacobian product of the forward's formula with its rounding steps taken as exact; each
 * gradient is rounded once, to its input's dtype. With yhat the normalized h (the statistics are
 * recomputed from h), n = yhat * weight + bias (weight 1 and bias 0 when absent), g = dout:
 *   dshift = g;  dscale = g * n;  dn = g * (1 + scale);  dweight = dn * yhat;  dbias = dn
 *   RMS:    dh = rstd * (dn * weight - yhat * mean(dn * weight * yhat))
 *   Layer:  dh = rstd * (dn * weight - mean(dn * weight) - yhat * mean(dn * weight * yhat))
 *   dh += dh_out (the gradient of the output h of the add_ ops; dout absent: dh = dh_out alone,
 *   the backward of ltx_gated_residual)
 *   dx = dh;  dy = dh * gate (dh without gate);  dgate = dh * y
 * dx, dy: T. dscale, dgate: per row (the operand is not shared between rows), in the operand's
 * dtype. An operand shared by several rows gets partial sums instead (the *_sum matrices): rows
 * come in groups of group_rows consecutive rows that share the reduced operands' rows (weight and
 * bias: all rows), each group in chunks of at most chunk_rows rows; row c of a [chunks, hidden]
 * sum matrix holds the sum over chunk c (c / chunks_per_group is its group), in fp32 (float64 when
 * T is). The caller adds the chunks of each group up (ltx_norm_backward_chunks gives their count).
 * Without any sum matrix, group_rows and chunk_rows only have to be valid: the CUDA launcher then
 * schedules the rows in chunks of its own.
 * Operands: as in ltx_norm_modulate_args_t; gate and scale share one dtype; dout and dh_out: T.
 * Every pointer of an output not wanted is NULL. The C twin also takes T = LTX_FLOAT64 (computed
 * in double); the CUDA launcher takes rows of up to LTX_NORM_BACKWARD_MAX_HIDDEN elements.
 */
#define LTX_NORM_BACKWARD_MAX_HIDDEN 8192

typedef struct ltx_norm_backward_args {
  ltx_rows_t h;              /* the rows the forward normalized: x, or the add_ ops' output h */
  ltx_rows_t y, gate, scale; /* data NULL when absent or not needed */
  ltx_vector_t weight, bias; /* data NULL when absent; bias is read for dscale only */
  ltx_rows_t dout;           /* gradient of out; data NULL: no norm (gated_residual) */
  ltx_rows_t dh_out;         /* gradient of the output h; data NULL: zero */
  ltx_rows_t dx, dy;         /* gradients written (data NULL: not computed) */
  ltx_rows_t dscale, dgate;  /* per-row gradients (data NULL: not computed per row) */
  void *dscale_sum, *dshift_sum, *dgate_sum, *dweight_sum, *dbias_sum; /* [chunks, hidden] */
  ltx_norm_kind_t norm;
  int64_t hidden;
  int64_t group_rows; /* >= 1, divides the row count */
  int64_t chunk_rows; /* >= 1 */
  float eps;
} ltx_norm_backward_args_t;

/* Chunks of a backward launch: rows / group_rows groups of ceil(group_rows / chunk_rows). */
static inline int64_t ltx_norm_backward_chunks(int64_t rows, int64_t group_rows,
                                               int64_t chunk_rows) {
  if (rows <= 0 || group_rows <= 0 || chunk_rows <= 0) return 0;
  return rows / group_rows * ((group_rows + chunk_rows - 1) / chunk_rows);
}

/* A chunk length for `rows` rows in groups of group_rows: at most about 512 chunks in all (one
 * wave of 4 blocks on each of an H100's 132 SMs; fewer, longer ones for many rows, so the partial
 * sums stay a few percent of the traffic), 8 to 64 rows each. */
static inline int64_t ltx_norm_backward_chunk_rows(int64_t rows, int64_t group_rows) {
  int64_t r = (rows + 511) / 512;
  r = r < 8 ? 8 : r > 64 ? 64 : r;
  return r < group_rows ? r : group_rows > 0 ? group_rows : 1;
}

int ltx_norm_backward_cuda(const ltx_norm_backward_args_t* args, ltx_stream_t stream);
/* Over chunks [chunk_begin, chunk_end) only. */
int ltx_norm_backward_cpu(const ltx_norm_backward_args_t* args, int64_t chunk_begin,
                          int64_t chunk_end);

/*
 * Gated residual: out = round_T(x + R(y * gate)), or round_T(x + y) when gate.data is NULL.
 * Dtypes: x, y, out: T; gate: T (upcast = 0) or T/fp32 (upcast = 1). The C twin also takes
 * T = LTX_FLOAT64 (computed in double).
 */
int ltx_gated_residual_cuda(ltx_rows_t out, ltx_rows_t x, ltx_rows_t y, ltx_rows_t gate,
                            int64_t hidden, int upcast, ltx_stream_t stream);
int ltx_gated_residual_cpu(ltx_rows_t out, ltx_rows_t x, ltx_rows_t y, ltx_rows_t gate,
                           int64_t hidden, int upcast, int64_t row_begin, int64_t row_end);

/*
 * RMSNorm and/or rotary embedding of up to two tensors (q and k) in one launch.
 * Each row of a tensor holds `heads` heads of `head_dim` contiguous elements (row length
 * heads * head_dim). Per row, in fp32:
 *   v = x                                                       (normalize = 0)
 *   v = round_T(x * rsqrt(mean(x^2) + eps) * weight)            (normalize = 1; torch.nn.RMSNorm:
 *       one rounding; weight [heads * head_dim] optional)
 * then, when cos.data is not NULL, each head is rotated with its cos/sin row c, s (rot_dim
 * elements; head h of the row uses the cos row + h * cos_head_stride, same for sin):
 *   interleaved = 1 (pairs 2i, 2i+1; rot_dim == head_dim):
 *     o[2i]   = v[2i]   * c[2i]   - v[2i+1] * s[2i]
 *     o[2i+1] = v[2i+1] * c[2i+1] + v[2i]   * s[2i+1]
 *   interleaved = 0 (halves i, i + head_dim/2; rot_dim == head_dim, or head_dim/2 where both
 *   halves share c[i], s[i] as LTX-2's split RoPE):
 *     o[i]        = v[i]        * c[i]  - v[i+half] * s[i]
 *     o[i+half]   = v[i+half]   * c[i'] + v[i]      * s[i']   (i' = i + half, or i at rot_dim half)
 *   out = round_T(o)
 * x, out: T (both tensors the same T); cos, sin: T or fp32 (one dtype); weight: T or fp32. The C
 * twin also takes T = LTX_FLOAT64 (computed in double).
 * With a quant format (quant.group = head_dim), tensors[0].out holds the first tensor's out
 * quantized per head (Quantized outputs, above, with each head's values as the row): head h of row
 * r has its scale at quant.scale[r * heads + h] (attention's q: one scale per token and head). T
 * is then not LTX_FLOAT64.
 */
typedef struct ltx_rope_tensor {
  ltx_rows_t out, x;
  ltx_rows_t cos, sin;                      /* one row per x row; data NULL: no rotation */
  int64_t cos_head_stride, sin_head_stride; /* elements between consecutive heads' rows */
  ltx_vector_t weight;                      /* norm weight, [heads * head_dim]; data NULL: none */
} ltx_rope_tensor_t;

typedef struct ltx_qk_norm_rope_args {
  ltx_rope_tensor_t tensors[2];
  int num_tensors; /* 1 or 2 */
  int64_t heads;
  int64_t head_dim;
  int64_t rot_dim; /* cos/sin row length */
  int normalize;
  int interleaved;
  float eps;
  ltx_quant_t quant; /* format LTX_QUANT_NONE: tensors[0].out has dtype T */
} ltx_qk_norm_rope_args_t;

int ltx_qk_norm_rope_cuda(const ltx_qk_norm_rope_args_t* args, ltx_stream_t stream);
int ltx_qk_norm_rope_cpu(const ltx_qk_norm_rope_args_t* args, int tensor, int64_t row_begin,
                         int64_t row_end);

/*
 * Backward of ltx_qk_norm_rope (and of a rotation alone): for the gradient `grad` of each tensor's
 * output, the gradient dx of its input x and the partial sums of its norm weight's gradient,
 * computed in fp32 as the vector-Jacobian product of the forward's formula with its rounding steps
 * taken as exact; dx is rounded once, to T. Per row, with d = grad and each head's cos/sin row c, s
 * as in the forward:
 *   g = R^T d, the transposed rotation (the identity without cos/sin):
 *     interleaved: g[2i]   = d[2i]   * c[2i]   + d[2i+1] * s[2i+1]
 *                  g[2i+1] = d[2i+1] * c[2i+1] - d[2i]   * s[2i]
 *     halves:      g[i]      = d[i]      * c[i]  + d[i+half] * s[i']
 *                  g[i+half] = d[i+half] * c[i'] - d[i]      * s[i]      (i' as in the forward)
 *   normalize = 0: dx = g
 *   normalize = 1: xhat = x * rstd (rstd of x's row as in the forward), w the weight (1: none):
 *                  dx = rstd * (g * w - xhat * mean(g * w * xhat));  dweight = g * xhat
 * `forward` holds the forward's arguments with tensors[i].out the gradient dx written and
 * tensors[i].x the forward's input (read only when normalizing: a rotation's VJP does not depend on
 * it, and any rows of x's shape, such as grad's, describe it). The rows of each tensor come in
 * chunks of chunk_rows; row c of dweight_sum[i] ([chunks_i, heads * head_dim], fp32; float64 when
 * T is) holds the sum of dweight over chunk c of tensor i, for the caller to add up
 * (ltx_qk_norm_rope_backward_chunks gives chunks_i); NULL: not computed. The C twin also takes
 * T = LTX_FLOAT64 (computed in double); the CUDA launcher takes rows of up to
 * LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW elements.
 */
#define LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW 8192

typedef struct ltx_qk_norm_rope_backward_args {
  ltx_qk_norm_rope_args_t forward;
  ltx_rows_t grad[2];   /* the gradient of each tensor's output (T) */
  void* dweight_sum[2]; /* [chunks_i, heads * head_dim] partial sums; NULL: not computed */
  int64_t chunk_rows;   /* >= 1 */
} ltx_qk_norm_rope_backward_args_t;

/* Chunks of one tensor of `rows` rows. */
static inline int64_t ltx_qk_norm_rope_backward_chunks(int64_t rows, int64_t chunk_rows) {
  return rows <= 0 || chunk_rows <= 0 ? 0 : (rows + chunk_rows - 1) / chunk_rows;
}

/* A chunk length for `rows` rows (q's and k's together) of `row_length` elements: chunks short
 * enough that a launch fills a GPU (about 2^18 threads of 16 elements), at least 8 rows when the
 * weight gradient is summed (so its partial sums stay a few percent of the traffic), at most 64. */
static inline int64_t ltx_qk_norm_rope_backward_chunk_rows(int64_t rows, int64_t row_length,
                                                           int weight_sums) {
  int64_t r = rows / (((int64_t)1 << 22) / (row_length > 0 ? row_length : 1) + 1);
  if (weight_sums && r < 8) r = 8;
  return r < 1 ? 1 : r > 64 ? 64 : r;
}

int ltx_qk_norm_rope_backward_cuda(const ltx_qk_norm_rope_backward_args_t* args,
                                   ltx_stream_t stream);
/* Over chunks [chunk_begin, chunk_end) of tensor `tensor` only. */
int ltx_qk_norm_rope_backward_cpu(const ltx_qk_norm_rope_backward_args_t* args, int tensor,
                                  int64_t chunk_begin, int64_t chunk_end);

/* GELU variants. */
typedef enum ltx_gelu_approximate {
  LTX_GELU_NONE = 0, /* 0.5 x (1 + erf(x / sqrt(2))) */
  LTX_GELU_TANH = 1, /* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
} ltx_gelu_approximate_t;

/*
 * GELU, computed in fp32 and rounded once: out = round_T(gelu(x)), rows of `hidden` elements.
 * gated = 1 (GEGLU, as diffusers' GEGLU: hidden, gate = x.chunk(2, -1)): x rows hold 2 * hidden
 * elements and out = round_T(x[:hidden] * round_T(gelu(x[hidden:]))). x, out: T; the C twin also
 * takes T = LTX_FLOAT64 (computed in double, no rounding).
 */
int ltx_gelu_cuda(ltx_rows_t out, ltx_rows_t x, int64_t hidden, ltx_gelu_approximate_t approximate,
                  int gated, ltx_stream_t stream);
int ltx_gelu_cpu(ltx_rows_t out, ltx_rows_t x, int64_t hidden, ltx_gelu_approximate_t approximate,
                 int gated, int64_t row_begin, int64_t row_end);

/*
 * Backward of ltx_gelu: the gradient dx of x for the output gradient dout, with the forward's
 * rounding points (the vector-Jacobian product of the formula above, computed in fp32):
 *   GELU:   dx = round_T(dout * gelu'(x))
 *   GEGLU:  with x = [h | g]:  dx[:hidden] = round_T(dout * round_T(gelu(g))),
 *                              dx[hidden:] = round_T(gelu'(g) * round_T(dout * h))
 * dout rows hold `hidden` elements, x and dx rows 2 * hidden when gated. dx, dout, x: T (the C twin
 * also LTX_FLOAT64, in double).
 */
int ltx_gelu_backward_cuda(ltx_rows_t dx, ltx_rows_t dout, ltx_rows_t x, int64_t hidden,
                           ltx_gelu_approximate_t approximate, int gated, ltx_stream_t stream);
int ltx_gelu_backward_cpu(ltx_rows_t dx, ltx_rows_t dout, ltx_rows_t x, int64_t hidden,
                          ltx_gelu_approximate_t approximate, int gated, int64_t row_begin,
                          int64_t row_end);

/* Activations applied before a quantization (GELU in the form of an ltx_gelu_approximate_t). */
typedef enum ltx_activation {
  LTX_ACTIVATION_NONE = 0,
  LTX_ACTIVATION_GELU = 1, /* as ltx_gelu computes it */
} ltx_activation_t;

/*
 * Quantization (Quantized outputs, above; a format other than LTX_QUANT_NONE) of v = x, or of
 * v = round_T(gelu(x)) computed as ltx_gelu computes it with `approximate`: out [rows, hidden].
 * x: T (float32, float16, bfloat16). Also quantizes Linear weights [N, K] per output channel.
 */
int ltx_quantize_cuda(ltx_rows_t out, ltx_quant_t quant, ltx_rows_t x, int64_t hidden,
                      ltx_activation_t activation, ltx_gelu_approximate_t approximate,
                      ltx_stream_t stream);
int ltx_quantize_cpu(ltx_rows_t out, ltx_quant_t quant, ltx_rows_t x, int64_t hidden,
                     ltx_activation_t activation, ltx_gelu_approximate_t approximate,
                     int64_t row_begin, int64_t row_end);

/*
 * Attention: non-causal softmax attention of q [batch, q_len, heads, head_dim] over k and v
 * [batch, kv_len, heads, head_dim] (diffusers' layout), per batch b and head h:
 *   n_b      = the keys attended: key_lengths[b] clamped to [0, kv_len] (kv_len without lengths)
 *   s_ij     = scale * q[b, i, h, :] . k[b, j, h, :]                for j < n_b
 *   m_i      = max_j s_ij,   l_i = sum_j exp(s_ij - m_i)
 *   out[b, i, h, :] = round_T(sum_j exp(s_ij - m_i) * v[b, j, h, :] / l_i)
 *   lse[b, h, i]    = m_i + log(l_i)                                 (natural log)
 * A batch element with n_b = 0 gets out = 0 and lse = -inf. q, k, v and out are ltx_rows_t of
 * head_dim-element rows with sizes {batch, len, heads} (row (b, s, h) at b * stride[0] + s *
 * stride[1] + h * stride[2]: any strides, so slices of a fused qkv tensor are read in place).
 * Dtypes: q, k, v, out: T; lse: float32 (float64 when T is); key_lengths: int32 or int64.
 * The CUDA launcher takes T float16 or bfloat16, head_dim 64 or 128 and rows at 16-byte boundaries
 * (ltx_attention_cuda_takes_*, ltx_rows_aligned); it computes q.k and p.v on tensor cores (T
 * operands, fp32 accumulation), the probabilities p rounded to T before p.v, the sums in fp32. The
 * C twin takes T float32, float16, bfloat16 or float64 and any head_dim, computes in double and
 * rounds out once (via fp32, to T; exact in float64).
 */
typedef struct ltx_attention_args {
  ltx_rows_t out;           /* {batch, q_len, heads} rows of head_dim */
  ltx_rows_t q;             /* {batch, q_len, heads} */
  ltx_rows_t k, v;          /* {batch, kv_len, heads} */
  void* lse;                /* [batch, heads, q_len] contiguous; NULL: not written */
  ltx_vector_t key_lengths; /* [batch] contiguous int32/int64; data NULL: every key */
  int64_t head_dim;
  double scale;            /* (the CUDA kernel rounds scale * log2(e) to fp32) */
  void* workspace;         /* CUDA: ltx_attention_cuda_workspace(args) bytes, 8-byte aligned */
  int64_t workspace_bytes; /* (NULL, fewer bytes or misaligned: no work tile splits) */
} ltx_attention_args_t;

/* Whether the CUDA launcher takes a dtype T and a head_dim (its third limit, 16-byte aligned rows:
 * ltx_rows_aligned(&rows, 2, 16)); the C twin takes any. */
static inline int ltx_attention_cuda_takes_head_dim(int64_t head_dim) {
  return head_dim == 64 || head_dim == 128;
}
static inline int ltx_attention_cuda_takes_dtype(ltx_dtype_t dtype) {
  return dtype == LTX_FLOAT16 || dtype == LTX_BFLOAT16;
}

int ltx_attention_cuda(const ltx_attention_args_t* args, ltx_stream_t stream);
/* The workspace the CUDA launcher uses for a call on the current device (0 if none): where the
 * persistent grid's last round of work tiles would leave most SMs idle, it splits those tiles along
 * their keys over more CTAs and merges the parts' partial results through it. Set
 * LTX_KERNELS_ATTENTION_SPLIT=off in the environment to never split (0 here). */
int64_t ltx_attention_cuda_workspace(const ltx_attention_args_t* args);
/* Over query rows [row_begin, row_end) only, in q's row order ((b * q_len + i) * heads + h). */
int ltx_attention_cpu(const ltx_attention_args_t* args, int64_t row_begin, int64_t row_end);

/*
 * 8-bit attention: ltx_attention's formula (key lengths, scale, lse, no keys) over the dequantized
 * operands, per batch b and head h (kb = j / 128, key j's block):
 *   q[b, i, h, :] = q8[b, i, h, :] * q_scale[b, i, h]       (int8, a scale per token and head)
 *   k[b, j, h, :] = k8[b, j, h, :] * k_scale[b, h, kb]      (int8, a scale per head, 128 keys)
 *   v[b, j, h, d] = v8[b, h, d, c(j)] * v_scale[b, h, d]    (e4m3 transposed, a scale per channel)
 * q8 {batch, q_len, heads}, k8 {batch, kv_len, heads}: int8 rows of head_dim; v8 {batch, heads,
 * head_dim}: float8_e4m3 rows of kv_pad >= ltx_attention_v_pad(kv_len) columns, key j at column
 * c(j) = ltx_attention_v_column(j) (columns holding no key below kv_len may hold any codes); the
 * scales contiguous float32. out: T; lse as ltx_attention's (float64 when T is).
 * The CUDA launcher takes T float16 or bfloat16, head_dim 64 or 128 (ltx_attention_cuda_takes_*),
 * a compute capability 9.0 device, and q8, k8, v8 rows at 16-byte boundaries (ltx_rows_aligned);
 * it computes q8.k8 exactly in int32 on tensor cores, scales the scores in fp32, rounds the
 * probabilities times 448 to e4m3 before p.v8 (fp32 accumulation), l the row sum of the same
 * rounded probabilities (tensor cores), out = O v_scale / l, lse from that l. The C
 * twin takes T float32, float16, bfloat16 or float64 and any head_dim, computes in double and
 * rounds out once.
 */
#define LTX_ATTENTION_INT8_KEY_BLOCK 128 /* keys per k_scale */
typedef struct ltx_attention_int8_args {
  ltx_rows_t out;           /* {batch, q_len, heads} rows of head_dim: T */
  ltx_rows_t q8;            /* {batch, q_len, heads} rows of head_dim: int8 */
  ltx_rows_t k8;            /* {batch, kv_len, heads} rows of head_dim: int8 */
  ltx_rows_t v8;            /* {batch, heads, head_dim} rows of kv_pad keys: float8_e4m3 */
  const float* q_scale;     /* [batch, q_len, heads] */
  const float* k_scale;     /* [batch, heads, ceil(kv_len / 128)] */
  const float* v_scale;     /* [batch, heads, head_dim] */
  void* lse;                /* [batch, heads, q_len] contiguous; NULL: not written */
  ltx_vector_t key_lengths; /* [batch] contiguous int32/int64; data NULL: every key */
  int64_t head_dim, kv_pad;
  double scale;            /* (the CUDA kernel rounds scale * log2(e) to fp32) */
  void* workspace;         /* as ltx_attention_args_t's: ltx_attention_int8_cuda_workspace(args) */
  int64_t workspace_bytes; /* bytes */
} ltx_attention_int8_args_t;

int ltx_attention_int8_cuda(const ltx_attention_int8_args_t* args, ltx_stream_t stream);
int64_t ltx_attention_int8_cuda_workspace(const ltx_attention_int8_args_t* args);
/* Over query rows [row_begin, row_end) only, in q8's row order ((b * q_len + i) * heads + h). */
int ltx_attention_int8_cpu(const ltx_attention_int8_args_t* args, int64_t row_begin,
                           int64_t row_end);

/*
 * The 8-bit operands of attention (q: ltx_quantize with LTX_QUANT_I8_ROW over rows of head_dim),
 * from x = k or v [batch, kv_len, heads, head_dim] (rows {batch, kv_len, heads} of head_dim, any
 * strides, as ltx_attention's); pair p = b * heads + h.
 * ltx_quantize_attention_k: k smoothed by its mean over the sequence (softmax-invariant), INT8 with
 * one scale per head and block of LTX_ATTENTION_K_BLOCK keys:
 *     mean[b, h, :] = fl32(sum_s k[b, s, h, :] / kv_len)  (0 when kv_len is 0; summed in fp32 by
 *                     CUDA, in double by the C twin)
 *     c             = fl32(k - mean)
 *     per block j of keys [128 j, 128 j + 128) of a pair: a = amax of c over the block's keys and
 *     channels, with the LTX_QUANT_I8_ROW rule (ltx_i8_row_factor):
 *     codes[b, s, h, :] = clamp(rint(fl32(c * fl32(127 / a))), -127, 127),  scale[p, j] = a / 127
 *   codes: int8 [batch, kv_len, heads, head_dim] contiguous; scale: fp32 [batch, heads,
 *   ceil(kv_len / 128)] contiguous.
 * ltx_quantize_attention_v: v per channel in e4m3, transposed (keys contiguous):
 *     a[b, h, d] = amax over s of |v[b, s, h, d]|, with the LTX_QUANT_E4M3_ROW rule:
 *     codes[b, h, d, c(s)] = e4m3(fl32(v * fl32(448 / a))) for s < kv_len (c: the column of
 *                            key s, ltx_attention_v_column), the other columns up to kv_pad 0
 *     scale[b, h, d]    = a / 448
 *   codes: float8_e4m3fn [batch, heads, head_dim, kv_pad] contiguous, kv_pad = kv_len rounded up
 *   to LTX_ATTENTION_V_PAD (ltx_attention_v_pad); scale: fp32 [batch, heads, head_dim].
 * x: T (float32, float16, bfloat16). Both backends take a workspace of
 * ltx_attention_quant_workspace floats (CUDA: a reduction pass over x writes partial sums or maxima
 * there, the quantizing pass reads them; the C twin keeps pair p's mean or factors at p *
 * head_dim). The CUDA launchers take head_dim up to LTX_ATTENTION_QUANT_CUDA_MAX_HEAD_DIM; the C
 * twins run over pairs [pair_begin, pair_end) only.
 */
#define LTX_ATTENTION_K_BLOCK 128
#define LTX_ATTENTION_V_PAD 16 /* a multiple of 16: ltx_attention_v_column's groups */
#define LTX_ATTENTION_QUANT_CUDA_MAX_HEAD_DIM 256

typedef struct ltx_attention_quant_args {
  ltx_rows_t x; /* k or v: {batch, kv_len, heads} rows of head_dim */
  void* codes;  /* k8 (LTX_INT8) or v8 (LTX_FLOAT8_E4M3), contiguous as above */
  ltx_dtype_t codes_dtype;
  float* scale;     /* k_scale or v_scale */
  float* workspace; /* ltx_attention_quant_workspace(...) floats */
  int64_t head_dim;
} ltx_attention_quant_args_t;

static inline int64_t ltx_attention_v_pad(int64_t kv_len) {
  return (kv_len + LTX_ATTENTION_V_PAD - 1) / LTX_ATTENTION_V_PAD * LTX_ATTENTION_V_PAD;
}

/* The column of v8's rows that holds key j: each group of 16 keys stored in the order the Hopper
 * kernel's score accumulators hold them (key 16 g + 8 h + 2 t + e at column 16 g + 4 t + 2 h + e,
 * t < 4, h, e < 2), so that a thread's probabilities are already its fragment of the FP8 P V GEMM
 * (hopper_int8.cuh). A permutation within each group of 16: keys below kv_len lie below
 * ltx_attention_v_pad(kv_len). */
static inline LTX_HOST_DEVICE int64_t ltx_attention_v_column(int64_t key) {
  const int64_t r = key & 15; /* 8 h + 2 t + e */
  return (key & ~(int64_t)15) | ((r & 6) << 1) | ((r & 8) >> 2) | (r & 1);
}

/* The key that column `column` of v8's rows holds: ltx_attention_v_column's inverse (column
 * 16 g + 4 t + 2 h + e holds key 16 g + 8 h + 2 t + e). */
static inline LTX_HOST_DEVICE int64_t ltx_attention_v_key(int64_t column) {
  const int64_t r = column & 15; /* 4 t + 2 h + e */
  return (column & ~(int64_t)15) | ((r & 2) << 2) | ((r & 12) >> 1) | (r & 1);
}

/* Chunks of keys the CUDA reduction pass splits each pair's sequence into: about 4 blocks per SM
 * of an H100 in all, at most one per block of 128 keys. */
static inline int64_t ltx_attention_quant_chunks(int64_t pairs, int64_t kv_len) {
  const int64_t wanted = pairs > 0 ? (528 + pairs - 1) / pairs : 1;
  const int64_t blocks = (kv_len + LTX_ATTENTION_K_BLOCK - 1) / LTX_ATTENTION_K_BLOCK;
  const int64_t chunks = wanted < blocks ? wanted : blocks;
  return chunks < 1 ? 1 : chunks > 64 ? 64 : chunks;
}

/* Floats of the CUDA launchers' workspace: [pairs, chunks, head_dim]. */
static inline int64_t ltx_attention_quant_workspace(int64_t pairs, int64_t kv_len,
                                                    int64_t head_dim) {
  return pairs * ltx_attention_quant_chunks(pairs, kv_len) * head_dim;
}

int ltx_quantize_attention_k_cuda(const ltx_attention_quant_args_t* args, ltx_stream_t stream);
int ltx_quantize_attention_k_cpu(const ltx_attention_quant_args_t* args, int64_t pair_begin,
                                 int64_t pair_end);
int ltx_quantize_attention_v_cuda(const ltx_attention_quant_args_t* args, ltx_stream_t stream);
int ltx_quantize_attention_v_cpu(const ltx_attention_quant_args_t* args, int64_t pair_begin,
                                 int64_t pair_end);

#ifdef __cplusplus
}
#endif

#endif /* LTX_KERNELS_H_ */
