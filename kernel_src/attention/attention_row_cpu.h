/* One query row of attention in double, written once for the C twins of the attention ops
 * (attention_cpu.c over T operands, attention_int8_cpu.c over the dequantized 8-bit ones): each
 * twin reads its operands through two callbacks, this computes the softmax and stores the row. */
#ifndef LTX_ATTENTION_ROW_CPU_H_
#define LTX_ATTENTION_ROW_CPU_H_

#include "../cpu_utils.h"

/* Output channels accumulated at once: the scores are recomputed per chunk, so no buffer is
 * allocated and any head_dim works. */
#define LTX_ATTENTION_CPU_CHUNK 64

/* The operands of a query row as a twin reads them (ctx: the twin's row state), in double: the
 * score s_j = scale * q . k_j of key j, and channels [c, c + width) of key j's value row into v. */
typedef double (*ltx_attention_score_fn)(const void* ctx, int64_t j);
typedef void (*ltx_attention_values_fn)(const void* ctx, int64_t j, int64_t c, int64_t width,
                                        double* v);

/* The row over its n keys: the scores' max m, l = sum_j exp(s_j - m), out[d] = (sum_j exp(s_j - m)
 * v_j[d]) * v_scale[d] / l (without the factor when v_scale is NULL), accumulated in double over
 * chunks of LTX_ATTENTION_CPU_CHUNK channels and stored at out_row (head_dim elements of
 * out_dtype) rounded once; lse = m + log(l) stored as lse[lse_index] (double when out_dtype is
 * float64, else float; none when lse is NULL). No keys (n = 0): out = 0 and lse = -inf. */
static inline void ltx_attention_row_cpu(int64_t n, int64_t head_dim, ltx_attention_score_fn score,
                                         ltx_attention_values_fn values, const void* ctx,
                                         const float* v_scale, void* out_row, ltx_dtype_t out_dtype,
                                         void* lse, int64_t lse_index) {
  double m = -INFINITY, l = 0.0;
  int64_t j, c, d;
  for (j = 0; j < n; ++j) {
    const double s = score(ctx, j);
    m = s > m ? s : m;
  }
  for (j = 0; j < n; ++j) l += exp(score(ctx, j) - m);
  for (c = 0; c < head_dim; c += LTX_ATTENTION_CPU_CHUNK) {
    const int64_t width =
        head_dim - c < LTX_ATTENTION_CPU_CHUNK ? head_dim - c : LTX_ATTENTION_CPU_CHUNK;
    double acc[LTX_ATTENTION_CPU_CHUNK] = {0.0}, v[LTX_ATTENTION_CPU_CHUNK];
    for (j = 0; j < n; ++j) {
      const double p = exp(score(ctx, j) - m);
      values(ctx, j, c, width, v);
      for (d = 0; d < width; ++d) acc[d] += p * v[d];
    }
    for (d = 0; d < width; ++d) {
      const double sum = v_scale ? acc[d] * v_scale[c + d] : acc[d];
      ltx_store_double(out_row, out_dtype, c + d, n ? sum / l : 0.0);
    }
  }
  if (lse) {
    const double row_lse = n ? m + log(l) : -INFINITY;
    if (out_dtype == LTX_FLOAT64)
      ((double*)lse)[lse_index] = row_lse;
    else
      ((float*)lse)[lse_index] = (float)row_lse;
  }
}

#endif /* LTX_ATTENTION_ROW_CPU_H_ */
