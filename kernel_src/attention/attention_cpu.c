/* Attention (portable C, the CPU backend): ltx_attention_cuda's formula (ltx_kernels.h) computed
 * in double, one query row at a time (attention_row_cpu.h): the row's scores s_j = scale * q . k_j
 * over the n_b keys of its batch element and its values v_j read from the T operands, rounded
 * once to T. */
#include "attention_row_cpu.h"

/* Query row (b, i, h): key j of (b, h) is row first_key + j * heads of k and v. */
typedef struct attention_row {
  const ltx_attention_args_t* a;
  const void* q_row;
  int64_t first_key, heads;
} attention_row_t;

static double attention_score(const void* ctx, int64_t j) {
  const attention_row_t* r = (const attention_row_t*)ctx;
  const ltx_attention_args_t* a = r->a;
  const void* k_row = ltx_row_ptr(&a->k, r->first_key + j * r->heads);
  double dot = 0.0;
  int64_t d;
  for (d = 0; d < a->head_dim; ++d)
    dot += ltx_load_double(r->q_row, a->q.dtype, d) * ltx_load_double(k_row, a->k.dtype, d);
  return a->scale * dot;
}

static void attention_values(const void* ctx, int64_t j, int64_t c, int64_t width, double* v) {
  const attention_row_t* r = (const attention_row_t*)ctx;
  const void* v_row = ltx_row_ptr(&r->a->v, r->first_key + j * r->heads);
  int64_t d;
  for (d = 0; d < width; ++d) v[d] = ltx_load_double(v_row, r->a->v.dtype, c + d);
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
    const int64_t h = row % heads, i = row / heads % q_len, b = row / heads / q_len;
    const attention_row_t r = {a, ltx_row_ptr(&a->q, row), b * kv_len * heads + h, heads};
    ltx_attention_row_cpu(ltx_attended_keys(&a->key_lengths, b, kv_len), a->head_dim,
                          attention_score, attention_values, &r, NULL, ltx_row_ptr(&a->out, row),
                          a->out.dtype, a->lse, (b * heads + h) * q_len + i);
  }
  return LTX_OK;
}
