/*
 * The argument rules of every launcher, written once (plain C11). Each CUDA launcher and its C
 * twin start with their op's check and return its status; the torch binding runs the same check
 * and turns a failure into a message that names the op, the argument and the rule.
 */
#ifndef LTX_CHECKS_H_
#define LTX_CHECKS_H_

#include "ltx_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The rule an argument breaks; `arg` and `ref` are ltx_check_t's. */
typedef enum ltx_rule {
  LTX_RULE_NONE = 0,               /* every argument is valid */
  LTX_RULE_MALFORMED,              /* arg is malformed: negative sizes, NULL data with rows, a size,
                                      flag or enum out of range */
  LTX_RULE_ROW_COUNT,              /* arg must describe as many rows as ref */
  LTX_RULE_REQUIRES,               /* arg is only allowed together with ref */
  LTX_RULE_FLOAT_DTYPE,            /* arg must be float32, float16 or bfloat16 */
  LTX_RULE_FLOAT_OR_FLOAT64_DTYPE, /* arg must be float32, float16, bfloat16 or float64 */
  LTX_RULE_DTYPE_OF,               /* arg must have ref's dtype */
  LTX_RULE_MODEL_DTYPE,            /* arg must have ref's (x's) dtype, as upcast is 0 */
  LTX_RULE_DTYPE_OF_OR_FLOAT32,    /* arg must have ref's dtype or be float32 */
  LTX_RULE_SAME_DTYPE_AS,          /* arg must have the dtype of ref (operands that share one) */
  LTX_RULE_EPS,                    /* eps (value) must be finite and >= 0 */
  LTX_RULE_EVEN_HEAD_DIM,          /* a rotation needs an even head_dim (value) */
  LTX_RULE_ROT_DIM,                /* rot_dim (value) must be head_dim (expected) */
  LTX_RULE_ROT_DIM_OR_HALF,        /* rot_dim (value) must be head_dim (expected) or half of it */
  LTX_RULE_INDEX_DTYPE,            /* arg must be int32 or int64 */
  LTX_RULE_SHAPE_OF,               /* arg's sizes must agree with ref's (the op says which) */
  LTX_RULE_FINITE,                 /* arg (value) must be finite */
  LTX_RULE_CODE_DTYPE,             /* arg must be codes of ref_dtype (int8, float8_e4m3fn) */
} ltx_rule_t;

/* What a check found. */
typedef struct ltx_check {
  int status;      /* LTX_OK, or the LTX_ERR_* the launcher returns */
  ltx_rule_t rule; /* LTX_RULE_NONE when status is LTX_OK */
  const char* arg; /* the argument at fault, named as in ltx_kernels.h ("gate", "tensors[1].cos") */
  const char* ref; /* the argument the rule relates it to, or NULL */
  ltx_dtype_t arg_dtype, ref_dtype; /* dtype rules: arg's dtype and the one it must match */
  double value;                     /* eps and size rules: the value found */
  int64_t expected;                 /* size rules: the value expected */
} ltx_check_t;

ltx_check_t ltx_check_rmsnorm(const ltx_rows_t* out, const ltx_rows_t* x, const void* weight,
                              ltx_dtype_t weight_dtype, int64_t hidden, float eps);
ltx_check_t ltx_check_norm_modulate(const ltx_norm_modulate_args_t* args);
ltx_check_t ltx_check_norm_backward(const ltx_norm_backward_args_t* args);
ltx_check_t ltx_check_gated_residual(const ltx_rows_t* out, const ltx_rows_t* x,
                                     const ltx_rows_t* y, const ltx_rows_t* gate, int64_t hidden,
                                     int upcast);
ltx_check_t ltx_check_qk_norm_rope(const ltx_qk_norm_rope_args_t* args);
ltx_check_t ltx_check_qk_norm_rope_backward(const ltx_qk_norm_rope_backward_args_t* args);
ltx_check_t ltx_check_gelu(const ltx_rows_t* out, const ltx_rows_t* x, int64_t hidden,
                           ltx_gelu_approximate_t approximate, int gated);
ltx_check_t ltx_check_quantize(const ltx_rows_t* out, const ltx_quant_t* quant, const ltx_rows_t* x,
                               int64_t hidden, ltx_activation_t activation,
                               ltx_gelu_approximate_t approximate);
ltx_check_t ltx_check_gelu_backward(const ltx_rows_t* dx, const ltx_rows_t* dout,
                                    const ltx_rows_t* x, int64_t hidden,
                                    ltx_gelu_approximate_t approximate, int gated);
ltx_check_t ltx_check_attention(const ltx_attention_args_t* args);
ltx_check_t ltx_check_attention_int8(const ltx_attention_int8_args_t* args);
ltx_check_t ltx_check_quantize_attention_k(const ltx_attention_quant_args_t* args);
ltx_check_t ltx_check_quantize_attention_v(const ltx_attention_quant_args_t* args);

#ifdef __cplusplus
}
#endif

#endif /* LTX_CHECKS_H_ */
