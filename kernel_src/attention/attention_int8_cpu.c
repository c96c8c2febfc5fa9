/* 8-bit attention (portable C, the CPU backend): ltx_attention_int8_cuda's formula (ltx_kernels.h)
 * computed in double over the dequantized operands, one query row at a time (attention_row_cpu.h):
 * the scores s_j = scale * q_scale * k_scale[j / 128] * (q8 . k8_j) (the integer dot product
 * exact), the values v8[:, c(j)] (e4m3 codes of v's transposed rows, key j at column
 * c(j) = ltx_attention_v_column(j)) and out's per-channel factor
 * v_scale, rounded once to T. */
#include "attention_row_cpu.h"

/* A float8_e4m3fn code's value (no infinities; 0x7f and 0xff are NaN). */
static double e4m3_value(uint8_t code) {
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  const double magnitude = exponent == 15 && mantissa == 7 ? NAN
                           : exponent == 0                 ? ldexp(mantissa, -9)
                                                           : ldexp(8 + mantissa, exponent - 10);
  return code & 0x80 ? -magnitude : magnitude;
}

/* Query row (b, i, h) of q8 (q_factor = scale * q_scale): key j of (b, h) is row
 * first_key + j * heads of k8 with scale k_scale[j / 128], and column c(j) of v8's rows
 * first_channel + d. */
typedef struct int8_attention_row {
  const ltx_attention_int8_args_t* a;
  const int8_t* q_row;
  double q_factor;
  const float* k_scale;
  int64_t first_key, heads, first_channel;
} int8_attention_row_t;

static double int8_score(const void* ctx, int64_t j) {
  const int8_attention_row_t* r = (const int8_attention_row_t*)ctx;
  const int8_t* k_row = (const int8_t*)ltx_row_ptr(&r->a->k8, r->first_key + j * r->heads);
  int64_t dot = 0, d;
  for (d = 0; d < r->a->head_dim; ++d) dot += (int64_t)r->q_row[d] * k_row[d];
  return r->q_factor * r->k_scale[j / LTX_ATTENTION_INT8_KEY_BLOCK] * (double)dot;
}

static void int8_values(const void* ctx, int64_t j, int64_t c, int64_t width, double* v) {
  const int8_attention_row_t* r = (const int8_attention_row_t*)ctx;
  const int64_t column = ltx_attention_v_column(j);
  int64_t d;
  for (d = 0; d < width; ++d)
    v[d] = e4m3_value(((const uint8_t*)ltx_row_ptr(&r->a->v8, r->first_channel + c + d))[column]);
}

int ltx_attention_int8_cpu(const ltx_attention_int8_args_t* args, int64_t row_begin,
                           int64_t row_end) {
  const ltx_attention_int8_args_t* a = args;
  const ltx_check_t check = ltx_check_attention_int8(a);
  int64_t heads, q_len, kv_len, blocks, row;
  const int status = ltx_cpu_status(check, row_begin, row_end, ltx_num_rows(&a->q8));
  if (status != LTX_OK) return status;
  q_len = a->q8.size[1];
  heads = a->q8.size[2];
  kv_len = a->k8.size[1];
  blocks = (kv_len + LTX_ATTENTION_INT8_KEY_BLOCK - 1) / LTX_ATTENTION_INT8_KEY_BLOCK;

  for (row = row_begin; row < row_end; ++row) {
    const int64_t h = row % heads, i = row / heads % q_len, b = row / heads / q_len;
    const int64_t head = b * heads + h;
    const int8_attention_row_t r = {a,
                                    (const int8_t*)ltx_row_ptr(&a->q8, row),
                                    a->scale * a->q_scale[row],
                                    a->k_scale + head * blocks,
                                    b * kv_len * heads + h,
                                    heads,
                                    head * a->head_dim};
    ltx_attention_row_cpu(ltx_attended_keys(&a->key_lengths, b, kv_len), a->head_dim, int8_score,
                          int8_values, &r, a->v_scale + head * a->head_dim,
                          ltx_row_ptr(&a->out, row), a->out.dtype, a->lse, head * q_len + i);
  }
  return LTX_OK;
}
