/*
 * Portable C helpers shared by the CPU implementations of ltx_kernels, written once:
 * bit-exact fp16/bf16 <-> fp32 conversion (round to nearest even, as CUDA's __float2*_rn),
 * element load/store by dtype and row addressing of ltx_rows_t (the row helpers and argument checks
 * they share with the CUDA launchers are rows.h and checks.h).
 */
#ifndef LTX_CPU_UTILS_H_
#define LTX_CPU_UTILS_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "checks.h"
#include "ltx_kernels.h"
#include "rows.h"

static inline float ltx_bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint32_t ltx_float_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof bits);
  return bits;
}

static inline float ltx_bf16_to_float(uint16_t h) { return ltx_bits_to_float((uint32_t)h << 16); }

static inline uint16_t ltx_float_to_bf16(float f) {
  uint32_t bits = ltx_float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static inline float ltx_half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return ltx_bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 is exact in fp32 */
    const float magnitude = (float)mantissa * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return ltx_bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t ltx_float_to_half(float f) {
  const uint32_t bits = ltx_float_to_bits(f);
  const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
  if (magnitude >= 0x47800000u) return sign | 0x7c00u; /* >= 65536 (and inf): inf */
  if (magnitude < 0x38800000u) { /* below 2^-14: subnormal half, units of 2^-24 */
    const float units = ltx_bits_to_float(magnitude) * 16777216.0f; /* exact scaling */
    return sign | (uint16_t)nearbyintf(units);                      /* ties to even */
  }
  magnitude += 0xfffu + ((magnitude >> 13) & 1u);            /* round to nearest even at bit 13 */
  return sign | (uint16_t)((magnitude - 0x38000000u) >> 13); /* rebias; may round up to inf */
}

/* Element i of an array of `dtype`, as float. */
static inline float ltx_load(const void* base, ltx_dtype_t dtype, int64_t i) {
  switch (dtype) {
    case LTX_FLOAT16: return ltx_half_to_float(((const uint16_t*)base)[i]);
    case LTX_BFLOAT16: return ltx_bf16_to_float(((const uint16_t*)base)[i]);
    case LTX_FLOAT64: return (float)((const double*)base)[i];
    default: return ((const float*)base)[i];
  }
}

/* Store v, rounded to nearest even, as element i of an array of `dtype`. */
static inline void ltx_store(void* base, ltx_dtype_t dtype, int64_t i, float v) {
  switch (dtype) {
    case LTX_FLOAT16: ((uint16_t*)base)[i] = ltx_float_to_half(v); break;
    case LTX_BFLOAT16: ((uint16_t*)base)[i] = ltx_float_to_bf16(v); break;
    case LTX_FLOAT64: ((double*)base)[i] = v; break;
    default: ((float*)base)[i] = v; break;
  }
}

/* The double forms, for C twins that also take LTX_FLOAT64 (computed in double): element i as
 * double, and v stored exactly in a float64 array, else rounded to fp32 first (the fp32 arithmetic
 * of the other dtypes) and then to `dtype`. */
static inline double ltx_load_double(const void* base, ltx_dtype_t dtype, int64_t i) {
  return dtype == LTX_FLOAT64 ? ((const double*)base)[i] : (double)ltx_load(base, dtype, i);
}

static inline void ltx_store_double(void* base, ltx_dtype_t dtype, int64_t i, double v) {
  if (dtype == LTX_FLOAT64)
    ((double*)base)[i] = v;
  else
    ltx_store(base, dtype, i, (float)v);
}

/* v as the CUDA kernels compute it for tensors of `dtype`: rounded to fp32, or kept in double for
 * float64 tensors. */
static inline double ltx_compute_precision(ltx_dtype_t dtype, double v) {
  return dtype == LTX_FLOAT64 ? v : (double)(float)v;
}

/* v rounded as the op rounds an intermediate to `dtype` (a `.to(dtype)` of the PyTorch code): to
 * fp32 then `dtype`; unchanged in float64. */
static inline double ltx_round_double(ltx_dtype_t dtype, double v) {
  switch (dtype) {
    case LTX_FLOAT16: return ltx_half_to_float(ltx_float_to_half((float)v));
    case LTX_BFLOAT16: return ltx_bf16_to_float(ltx_float_to_bf16((float)v));
    case LTX_FLOAT32: return (float)v;
    default: return v;
  }
}

/* GELU in double (gelu_cpu.c gives the forms); also the activation of ltx_quantize_cpu. */
#define LTX_SQRT_2_OVER_PI 0.79788456080286535588
#define LTX_INV_SQRT_2 0.70710678118654752440
#define LTX_INV_SQRT_2PI 0.39894228040143267794

/* gelu(x) (derivative = 0) or gelu'(x) (derivative = 1), in double. */
static inline double ltx_gelu_double(double x, ltx_gelu_approximate_t approximate, int derivative) {
  if (approximate == LTX_GELU_TANH) {
    const double t = 2.0 * LTX_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    const double e = exp(-fabs(t)); /* s(t) and s(-t) from e <= 1: nothing overflows */
    const double s_pos = t >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
    const double s_neg = t >= 0 ? e / (1.0 + e) : 1.0 / (1.0 + e);
    if (!derivative) return x * s_pos;
    return s_pos + x * s_pos * s_neg * 2.0 * LTX_SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x);
  }
  {
    const double phi_cdf = 0.5 * erfc(-x * LTX_INV_SQRT_2);
    if (!derivative) return x * phi_cdf;
    return phi_cdf + x * LTX_INV_SQRT_2PI * exp(-0.5 * x * x);
  }
}

/* fp32 -> float8_e4m3fn bits, rounded to nearest even and saturated to +-448 (NaN stays NaN), as
 * CUDA's __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3). */
static inline uint8_t ltx_float_to_e4m3(float v) {
  const uint8_t sign = (uint8_t)((ltx_float_to_bits(v) >> 24) & 0x80u);
  const float magnitude = fabsf(v);
  uint32_t bits;
  if (magnitude != magnitude) return sign | 0x7fu;
  if (magnitude >= LTX_E4M3_MAX) return sign | 0x7eu;
  if (magnitude < 0.015625f) /* below 2^-6: subnormal, units of 2^-9 (exact scaling) */
    return sign | (uint8_t)nearbyintf(magnitude * 512.f); /* ties to even; 8 is 2^-6 itself */
  bits = ltx_float_to_bits(magnitude);
  bits += 0x7ffffu + ((bits >> 20) & 1u); /* round to nearest even at mantissa bit 20 */
  bits = (((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u); /* rebias 127 -> 7, 3 bits */
  return sign | (uint8_t)(bits > 0x7eu ? 0x7eu : bits);
}

/* max(m, |v|), NaN-propagating (a NaN anywhere in the row makes the amax NaN). */
static inline float ltx_amax_step(float m, float v) {
  const float a = fabsf(v);
  return (a > m || a != a) ? a : m; /* (a NaN m stays: NaN > a and a != a are both false) */
}

/* Element i of a row that a C twin quantizes: its value rounded to T (ctx: the twin's row state).
 */
typedef float (*ltx_row_value_fn)(const void* ctx, int64_t i);

/* The LTX_QUANT_I8_ROW code of v (already multiplied by the row's factor): rint, ties to even (the
 * default rounding mode), clamped to +-127; NaN gives 0 (as CUDA's cvt.rni does). */
static inline int8_t ltx_float_to_i8(float v) {
  const float r = nearbyintf(v);
  if (r != r) return 0;
  return (int8_t)(r > LTX_I8_MAX ? LTX_I8_MAX : r < -LTX_I8_MAX ? -LTX_I8_MAX : r);
}

/* The quantized-output epilogue of the C twins (ltx_kernels.h, Quantized outputs; the device's is
 * device/quant.cuh): row `row` of `hidden` values value(ctx, i), computed twice (the row's amax,
 * then its codes), written as its scale and its codes at `codes`. quant's format is
 * LTX_QUANT_E4M3_ROW or LTX_QUANT_I8_ROW, the formats checks.c lets through. */
static inline void ltx_quantize_row(const ltx_quant_t* quant, int64_t row, void* codes,
                                    int64_t hidden, ltx_row_value_fn value, const void* ctx) {
  const int i8 = quant->format == LTX_QUANT_I8_ROW;
  float amax = 0.f, factor;
  int64_t i;
  for (i = 0; i < hidden; ++i) amax = ltx_amax_step(amax, value(ctx, i));
  factor = i8 ? ltx_i8_row_factor(amax, &quant->scale[row])
              : ltx_e4m3_row_factor(amax, &quant->scale[row]);
  for (i = 0; i < hidden; ++i) {
    const float v = value(ctx, i) * factor;
    if (i8)
      ((int8_t*)codes)[i] = ltx_float_to_i8(v);
    else
      ((uint8_t*)codes)[i] = ltx_float_to_e4m3(v);
  }
}

/* Status of the checks a C implementation starts with: its op's argument rules, then the row
 * range [row_begin, row_end) of its call. */
static inline int ltx_cpu_status(ltx_check_t check, int64_t row_begin, int64_t row_end,
                                 int64_t rows) {
  if (check.status != LTX_OK) return check.status;
  return row_begin < 0 || row_end > rows ? LTX_ERR_INVALID_ARGUMENT : LTX_OK;
}

/* Address of the first element of row `row` (see ltx_rows_t). */
static inline void* ltx_row_ptr(const ltx_rows_t* r, int64_t row) {
  const int64_t i2 = row % r->size[2], rest = row / r->size[2];
  const int64_t i1 = rest % r->size[1], i0 = rest / r->size[1];
  const int64_t offset = i0 * r->stride[0] + i1 * r->stride[1] + i2 * r->stride[2];
  return (char*)r->data + offset * ltx_dtype_size(r->dtype);
}

/* The keys batch element b attends (the attention ops): key_lengths[b] clamped to [0, kv_len]
 * (all without lengths). */
static inline int64_t ltx_attended_keys(const ltx_vector_t* key_lengths, int64_t b,
                                        int64_t kv_len) {
  int64_t n;
  if (!key_lengths->data) return kv_len;
  n = key_lengths->dtype == LTX_INT32 ? (int64_t)((const int32_t*)key_lengths->data)[b]
                                      : ((const int64_t*)key_lengths->data)[b];
  return n < 0 ? 0 : n > kv_len ? kv_len : n;
}

#endif /* LTX_CPU_UTILS_H_ */
