/* 8-bit attention (portable C, the CPU backend): ltx_attention_int8_cuda's formula (ltx_kernels.h)
 * computed in double over the dequantized operands, one query row at a time as attention_cpu.c
 * does: the scores s_j = scale * q_scale * k_scale[j / 128] * (q8 . k8_j) (the integer dot product
 * exact), their max m, l = sum_j exp(s_j - m), out = sum_j exp(s_j - m) v8[:, j] v_scale / l,
 * accumulated over chunks of LTX_ATTENTION_CPU_CHUNK channels, rounded once to T; lse = m + log(l).
 * A batch element with no keys gets out = 0 and lse = -inf. */
#include "../cpu_utils.h"

#define LTX_ATTENTION_INT8_CPU_CHUNK 64

/* A float8_e4m3fn code's value (no infinities; 0x7f and 0xff are NaN). */
static double e4m3_value(uint8_t code) {
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  const double magnitude = exponent == 15 && mantissa == 7 ? NAN
                           : exponent == 0                 ? ldexp(mantissa, -9)
                                                           : ldexp(8 + mantissa, exponent - 10);
  return code & 0x80 ? -magnitude : magnitude;
}

/* Score of query row q_row (scale q_factor = scale * q_scale) against key j of (b, h). */
static double int8_score(const ltx_attention_int8_args_t* a, const int8_t* q_row, double q_factor,
                         int64_t b, int64_t h, int64_t j) {
  const int64_t heads = a->q8.size[2], kv_len = a->k8.size[1];
  const int64_t blocks = (kv_len + LTX_ATTENTION_INT8_KEY_BLOCK - 1) / LTX_ATTENTION_INT8_KEY_BLOCK;
  const int8_t* k_row = (const int8_t*)ltx_row_ptr(&a->k8, (b * kv_len + j) * heads + h);
  int64_t dot = 0, d;
  for (d = 0; d < a->head_dim; ++d) dot += (int64_t)q_row[d] * k_row[d];
  return q_factor * a->k_scale[(b * heads + h) * blocks + j / LTX_ATTENTION_INT8_KEY_BLOCK] *
         (double)dot;
}

int ltx_attention_int8_cpu(const ltx_attention_int8_args_t* args, int64_t row_begin,
                           int64_t row_end) {
  const ltx_attention_int8_args_t* a = args;
  const ltx_check_t check = ltx_check_attention_int8(a);
  int64_t heads, q_len, kv_len, row;
  const int status = ltx_cpu_status(check, row_begin, row_end, ltx_num_rows(&a->q8));
  if (status != LTX_OK) return status;
  q_len = a->q8.size[1];
  heads = a->q8.size[2];
  kv_len = a->k8.size[1];

  for (row = row_begin; row < row_end; ++row) {
    const int64_t h = row % heads, i = row / heads % q_len, b = row / heads / q_len;
    const int64_t n = ltx_attended_keys(&a->key_lengths, b, kv_len);
    const int8_t* q_row = (const int8_t*)ltx_row_ptr(&a->q8, row);
    const double q_factor = a->scale * a->q_scale[row];
    const float* v_scale = a->v_scale + (b * heads + h) * a->head_dim;
    void* out_row = ltx_row_ptr(&a->out, row);
    double m = -INFINITY, l = 0.0;
    int64_t j, c, d;
    for (j = 0; j < n; ++j) {
      const double s = int8_score(a, q_row, q_factor, b, h, j);
      m = s > m ? s : m;
    }
    for (j = 0; j < n; ++j) l += exp(int8_score(a, q_row, q_factor, b, h, j) - m);
    for (c = 0; c < a->head_dim; c += LTX_ATTENTION_INT8_CPU_CHUNK) {
      const int64_t width = a->head_dim - c < LTX_ATTENTION_INT8_CPU_CHUNK
                                ? a->head_dim - c
                                : LTX_ATTENTION_INT8_CPU_CHUNK;
      double acc[LTX_ATTENTION_INT8_CPU_CHUNK] = {0.0};
      for (j = 0; j < n; ++j) {
        const double p = exp(int8_score(a, q_row, q_factor, b, h, j) - m);
        for (d = 0; d < width; ++d) {
          const uint8_t* v_row =
              (const uint8_t*)ltx_row_ptr(&a->v8, (b * heads + h) * a->head_dim + c + d);
          acc[d] += p * e4m3_value(v_row[j]);
        }
      }
      for (d = 0; d < width; ++d)
        ltx_store_double(out_row, a->out.dtype, c + d, n ? acc[d] * v_scale[c + d] / l : 0.0);
    }
    if (a->lse) {
      const int64_t at = (b * heads + h) * q_len + i;
      const double lse = n ? m + log(l) : -INFINITY;
      if (a->out.dtype == LTX_FLOAT64)
        ((double*)a->lse)[at] = lse;
      else
        ((float*)a->lse)[at] = (float)lse;
    }
  }
  return LTX_OK;
}
