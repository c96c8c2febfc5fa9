/* Attention (portable C, the CPU backend): ltx_attention_cuda's formula (ltx_kernels.h) computed
 * in double, one query row at a time: the row's scores s_j = scale * q . k_j over the n_b keys of
 * its batch element, their max m, l = sum_j exp(s_j - m), then out = sum_j exp(s_j - m) v_j / l,
 * accumulated in double over chunks of LTX_ATTENTION_CPU_CHUNK output elements (the scores are
 * recomputed per chunk, so no buffer is allocated and any head_dim works), rounded once to T;
 * lse = m + log(l). A batch element with no keys gets out = 0 and lse = -inf. */
#include "../cpu_utils.h"

#define LTX_ATTENTION_CPU_CHUNK 64

/* scale * q_row . k_row over head_dim elements, in double. */
static double score(const ltx_attention_args_t* a, const void* q_row, const void* k_row) {
  double dot = 0.0;
  int64_t d;
  for (d = 0; d < a->head_dim; ++d)
    dot += ltx_load_double(q_row, a->q.dtype, d) * ltx_load_double(k_row, a->k.dtype, d);
  return a->scale * dot;
}

int ltx_attention_cpu(const ltx_attention_args_t* args, int64_t row_begin, int64_t row_end) {
  const ltx_attention_args_t* a = args;
  const ltx_check_t check = ltx_check_attention(a);
  int64_t heads, q_len, kv_len, row;
  const int status = ltx_cpu_status(check, row_begin, row_end, ltx_num_rows(&a->q));
  if (status != LTX_OK) return status;
  q_len = a->q.size[1];
  heads = a->q.size[2];
  kv_len = a->k.size[1];

  for (row = row_begin; row < row_end; ++row) {
    /* Query row (b, i, h); key j of (b, h) is k's row (b * kv_len + j) * heads + h. */
    const int64_t h = row % heads, i = row / heads % q_len, b = row / heads / q_len;
    const int64_t n = ltx_attended_keys(&a->key_lengths, b, kv_len);
    const int64_t first_key = b * kv_len * heads + h;
    const void* q_row = ltx_row_ptr(&a->q, row);
    void* out_row = ltx_row_ptr(&a->out, row);
    double m = -INFINITY, l = 0.0;
    int64_t j, c, d;
    for (j = 0; j < n; ++j) {
      const double s = score(a, q_row, ltx_row_ptr(&a->k, first_key + j * heads));
      m = s > m ? s : m;
    }
    for (j = 0; j < n; ++j)
      l += exp(score(a, q_row, ltx_row_ptr(&a->k, first_key + j * heads)) - m);
    for (c = 0; c < a->head_dim; c += LTX_ATTENTION_CPU_CHUNK) {
      const int64_t width =
          a->head_dim - c < LTX_ATTENTION_CPU_CHUNK ? a->head_dim - c : LTX_ATTENTION_CPU_CHUNK;
      double acc[LTX_ATTENTION_CPU_CHUNK] = {0.0};
      for (j = 0; j < n; ++j) {
        const int64_t key = first_key + j * heads;
        const double p = exp(score(a, q_row, ltx_row_ptr(&a->k, key)) - m);
        const void* v_row = ltx_row_ptr(&a->v, key);
        for (d = 0; d < width; ++d) acc[d] += p * ltx_load_double(v_row, a->v.dtype, c + d);
      }
      for (d = 0; d < width; ++d)
        ltx_store_double(out_row, a->out.dtype, c + d, n ? acc[d] / l : 0.0);
    }
    if (a->lse) {
      const int64_t at = (b * heads + h) * q_len + i;
      const double lse = n ? m + log(l) : -INFINITY;
      if (a->q.dtype == LTX_FLOAT64)
        ((double*)a->lse)[at] = lse;
      else
        ((float*)a->lse)[at] = (float)lse;
    }
  }
  return LTX_OK;
}
