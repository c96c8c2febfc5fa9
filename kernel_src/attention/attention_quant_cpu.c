/* The 8-bit operands of attention (portable C, the CPU backend): ltx_quantize_attention_k_cuda's
 * and ltx_quantize_attention_v_cuda's rules (ltx_kernels.h), one (batch, head) pair at a time. K:
 * the pair's mean over the sequence summed in double and rounded once to fp32, then per block of
 * LTX_ATTENTION_K_BLOCK keys the amax of the centered values and their codes (recomputed in the
 * second pass). V: each channel's amax over the sequence, then its codes written transposed
 * (keys in ltx_attention_v_column order). The
 * pair's means or factors are kept in the workspace at pair * head_dim. */
#include "../cpu_utils.h"

/* Element d of key s of pair (b, h) of x, as fp32. */
static float pair_element(const ltx_rows_t* x, int64_t b, int64_t s, int64_t h, int64_t d) {
  const int64_t row = (b * x->size[1] + s) * x->size[2] + h;
  return ltx_load(ltx_row_ptr(x, row), x->dtype, d);
}

int ltx_quantize_attention_k_cpu(const ltx_attention_quant_args_t* a, int64_t pair_begin,
                                 int64_t pair_end) {
  const ltx_check_t check = ltx_check_quantize_attention_k(a);
  int64_t heads, kv_len, dim, blocks, pair, d, s, j;
  int status;
  if (check.status != LTX_OK) return check.status;
  heads = a->x.size[2];
  kv_len = a->x.size[1];
  dim = a->head_dim;
  blocks = (kv_len + LTX_ATTENTION_K_BLOCK - 1) / LTX_ATTENTION_K_BLOCK;
  status = ltx_cpu_status(check, pair_begin, pair_end, a->x.size[0] * heads);
  if (status != LTX_OK) return status;
  for (pair = pair_begin; pair < pair_end; ++pair) {
    const int64_t b = pair / heads, h = pair % heads;
    float* mean = a->workspace + pair * dim;
    for (d = 0; d < dim; ++d) {
      double sum = 0.0;
      for (s = 0; s < kv_len; ++s) sum += pair_element(&a->x, b, s, h, d);
      mean[d] = kv_len > 0 ? (float)(sum / (double)kv_len) : 0.f;
    }
    for (j = 0; j < blocks; ++j) {
      const int64_t first = j * LTX_ATTENTION_K_BLOCK;
      const int64_t end =
          first + LTX_ATTENTION_K_BLOCK < kv_len ? first + LTX_ATTENTION_K_BLOCK : kv_len;
      float amax = 0.f, factor;
      for (s = first; s < end; ++s)
        for (d = 0; d < dim; ++d)
          amax = ltx_amax_step(amax, pair_element(&a->x, b, s, h, d) - mean[d]);
      factor = ltx_i8_row_factor(amax, &a->scale[pair * blocks + j]);
      for (s = first; s < end; ++s) {
        int8_t* codes = (int8_t*)a->codes + ((b * kv_len + s) * heads + h) * dim;
        for (d = 0; d < dim; ++d)
          codes[d] = ltx_float_to_i8((pair_element(&a->x, b, s, h, d) - mean[d]) * factor);
      }
    }
  }
  return LTX_OK;
}

int ltx_quantize_attention_v_cpu(const ltx_attention_quant_args_t* a, int64_t pair_begin,
                                 int64_t pair_end) {
  const ltx_check_t check = ltx_check_quantize_attention_v(a);
  int64_t heads, kv_len, kv_pad, last_group, dim, pair, d, s;
  int status;
  if (check.status != LTX_OK) return check.status;
  heads = a->x.size[2];
  kv_len = a->x.size[1];
  kv_pad = ltx_attention_v_pad(kv_len);
  last_group = kv_len / 16 * 16; /* the first column of the last (partial) group of 16 keys */
  dim = a->head_dim;
  status = ltx_cpu_status(check, pair_begin, pair_end, a->x.size[0] * heads);
  if (status != LTX_OK) return status;
  for (pair = pair_begin; pair < pair_end; ++pair) {
    const int64_t b = pair / heads, h = pair % heads;
    float* factor = a->workspace + pair * dim;
    for (d = 0; d < dim; ++d) {
      float amax = 0.f;
      for (s = 0; s < kv_len; ++s) amax = ltx_amax_step(amax, pair_element(&a->x, b, s, h, d));
      factor[d] = ltx_e4m3_row_factor(amax, &a->scale[pair * dim + d]);
    }
    for (d = 0; d < dim; ++d) { /* channel d's keys, contiguous, in ltx_attention_v_column order */
      uint8_t* codes = (uint8_t*)a->codes + (pair * dim + d) * kv_pad;
      if (kv_pad > kv_len) /* the last group's columns (codes may be NULL without keys) */
        memset(codes + last_group, 0, (size_t)(kv_pad - last_group));
      for (s = 0; s < kv_len; ++s)
        codes[ltx_attention_v_column(s)] =
            ltx_float_to_e4m3(pair_element(&a->x, b, s, h, d) * factor[d]);
    }
  }
  return LTX_OK;
}
