/* The argument rules of every launcher (see checks.h and the op comments in ltx_kernels.h). The
 * checks run in a fixed order, so that the first rule broken is the one reported: dtypes of the
 * operands in argument order, then rows, then sizes and scalars. */
#include "checks.h"

#include <math.h>

#include "rows.h"

static ltx_check_t ok(void) {
  const ltx_check_t c = {.status = LTX_OK};
  return c;
}

static ltx_check_t fail(int status, ltx_rule_t rule, const char* arg, const char* ref) {
  const ltx_check_t c = {.status = status, .rule = rule, .arg = arg, .ref = ref};
  return c;
}

static ltx_check_t malformed(const char* arg) {
  return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_MALFORMED, arg, NULL);
}

static ltx_check_t dtype_fail(int status, ltx_rule_t rule, const char* arg, ltx_dtype_t arg_dtype,
                              const char* ref, ltx_dtype_t ref_dtype) {
  const ltx_check_t c = {.status = status,
                         .rule = rule,
                         .arg = arg,
                         .ref = ref,
                         .arg_dtype = arg_dtype,
                         .ref_dtype = ref_dtype};
  return c;
}

/* arg is float32, float16 or bfloat16. */
static ltx_check_t float_dtype(const char* arg, ltx_dtype_t dtype) {
  if (ltx_model_dtype(dtype)) return ok();
  return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_FLOAT_DTYPE, arg, dtype, NULL, dtype);
}

/* arg is a model dtype or float64 (ops whose C twin computes in double, for gradcheck). */
static ltx_check_t float_or_float64_dtype(const char* arg, ltx_dtype_t dtype) {
  if (ltx_model_dtype(dtype) || dtype == LTX_FLOAT64) return ok();
  return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_FLOAT_OR_FLOAT64_DTYPE, arg, dtype, NULL,
                    dtype);
}

/* arg has ref's dtype. */
static ltx_check_t dtype_of(int status, const char* arg, ltx_dtype_t dtype, const char* ref,
                            ltx_dtype_t ref_dtype) {
  if (dtype == ref_dtype) return ok();
  return dtype_fail(status, LTX_RULE_DTYPE_OF, arg, dtype, ref, ref_dtype);
}

/* An operand of the fused ops' rounding rules (ltx_kernels.h): x's dtype T, or with upcast also
 * float32. */
static ltx_check_t operand_dtype(int status, const char* arg, ltx_dtype_t dtype, ltx_dtype_t t,
                                 int upcast) {
  if (dtype == t || (upcast && dtype == LTX_FLOAT32)) return ok();
  return dtype_fail(status, upcast ? LTX_RULE_DTYPE_OF_OR_FLOAT32 : LTX_RULE_MODEL_DTYPE, arg,
                    dtype, "x", t);
}

/* arg describes `rows` valid rows (the rows of ref). */
static ltx_check_t rows_like(const char* arg, const ltx_rows_t* r, const char* ref, int64_t rows) {
  if (!ltx_valid_rows(r)) return malformed(arg);
  if (ltx_num_rows(r) != rows) return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_ROW_COUNT, arg, ref);
  return ok();
}

/* As rows_like, for an optional operand (data NULL: absent). */
static ltx_check_t optional_rows_like(const char* arg, const ltx_rows_t* r, const char* ref,
                                      int64_t rows) {
  return r->data ? rows_like(arg, r, ref, rows) : ok();
}

/* A quantized output (ltx_kernels.h, Quantized outputs) of `rows` rows: a format, out's dtype its
 * codes', a scale per row (or per group), and `group` elements per scale (0: the whole row). */
static ltx_check_t quantized_groups(const ltx_rows_t* out, const ltx_quant_t* q, int64_t rows,
                                    int64_t group) {
  if (q->format != LTX_QUANT_E4M3_ROW && q->format != LTX_QUANT_I8_ROW)
    return malformed("quant.format");
  if (out->dtype != (q->format == LTX_QUANT_I8_ROW ? LTX_INT8 : LTX_FLOAT8_E4M3))
    return malformed("out");
  if (!q->scale && rows > 0) return malformed("quant.scale");
  if (q->group != group) return malformed("quant.group");
  return ok();
}

static ltx_check_t quantized_output(const ltx_rows_t* out, const ltx_quant_t* q, int64_t rows) {
  return quantized_groups(out, q, rows, 0);
}

static ltx_check_t eps_rule(float eps) {
  const ltx_check_t c = {
      .status = LTX_ERR_INVALID_ARGUMENT, .rule = LTX_RULE_EPS, .arg = "eps", .value = eps};
  return eps >= 0.f && eps < INFINITY ? ok() : c; /* (NaN fails both) */
}

/* Returns the check's result from the calling check when it failed. */
#define LTX_RETURN_IF_FAILED(check)               \
  do {                                            \
    const ltx_check_t failed_ = (check);          \
    if (failed_.status != LTX_OK) return failed_; \
  } while (0)

ltx_check_t ltx_check_rmsnorm(const ltx_rows_t* out, const ltx_rows_t* x, const void* weight,
                              ltx_dtype_t weight_dtype, int64_t hidden, float eps) {
  LTX_RETURN_IF_FAILED(float_or_float64_dtype("x", x->dtype));
  /* The weight: any model dtype; a float64 x (the C twin, in double) takes a float64 one. */
  if (weight && x->dtype == LTX_FLOAT64)
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_UNSUPPORTED_DTYPE, "weight", weight_dtype, "x", x->dtype));
  else if (weight)
    LTX_RETURN_IF_FAILED(float_dtype("weight", weight_dtype));
  /* The output has the weight's dtype, x's without a weight (diffusers' RMSNorm). */
  if (weight)
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_INVALID_ARGUMENT, "out", out->dtype, "weight", weight_dtype));
  else
    LTX_RETURN_IF_FAILED(dtype_of(LTX_ERR_INVALID_ARGUMENT, "out", out->dtype, "x", x->dtype));
  if (!ltx_valid_rows(x)) return malformed("x");
  LTX_RETURN_IF_FAILED(rows_like("out", out, "x", ltx_num_rows(x)));
  if (hidden < 0) return malformed("hidden");
  return eps_rule(eps);
}

ltx_check_t ltx_check_norm_modulate(const ltx_norm_modulate_args_t* a) {
  const char* const modulation_names[3] = {"scale", "shift", "gate"};
  const ltx_rows_t* modulation[3];
  const ltx_rows_t* first_modulation = NULL;
  const char* first_modulation_name = NULL;
  ltx_dtype_t t;
  int64_t rows;
  int i;
  if (!a) return malformed("args");
  t = a->x.dtype;
  /* x: a model dtype, or float64 (the C twin, in double) unless out is quantized */
  LTX_RETURN_IF_FAILED(a->quant.format != LTX_QUANT_NONE ? float_dtype("x", t)
                                                         : float_or_float64_dtype("x", t));
  /* Modulation tensors: T (fp32 too with upcast), all of one dtype. */
  modulation[0] = &a->scale;
  modulation[1] = &a->shift;
  modulation[2] = &a->gate;
  for (i = 0; i < 3; ++i)
    if (modulation[i]->data)
      LTX_RETURN_IF_FAILED(operand_dtype(LTX_ERR_UNSUPPORTED_DTYPE, modulation_names[i],
                                         modulation[i]->dtype, t, a->upcast));
  for (i = 0; i < 3; ++i) {
    if (!modulation[i]->data) continue;
    if (first_modulation && modulation[i]->dtype != first_modulation->dtype)
      return dtype_fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SAME_DTYPE_AS, modulation_names[i],
                        modulation[i]->dtype, first_modulation_name, first_modulation->dtype);
    if (!first_modulation) {
      first_modulation = modulation[i];
      first_modulation_name = modulation_names[i];
    }
  }
  /* Activations: T. */
  if (a->y.data) LTX_RETURN_IF_FAILED(dtype_of(LTX_ERR_INVALID_ARGUMENT, "y", a->y.dtype, "x", t));
  if (a->residual_out.data)
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_INVALID_ARGUMENT, "residual_out", a->residual_out.dtype, "x", t));
  if (a->quant.format != LTX_QUANT_NONE) {
    LTX_RETURN_IF_FAILED(quantized_output(&a->out, &a->quant, ltx_num_rows(&a->x)));
  } else {
    LTX_RETURN_IF_FAILED(dtype_of(LTX_ERR_INVALID_ARGUMENT, "out", a->out.dtype, "x", t));
  }
  /* Weight and bias: T (fp32 too with upcast). */
  if (a->weight.data)
    LTX_RETURN_IF_FAILED(
        operand_dtype(LTX_ERR_UNSUPPORTED_DTYPE, "weight", a->weight.dtype, t, a->upcast));
  if (a->bias.data)
    LTX_RETURN_IF_FAILED(
        operand_dtype(LTX_ERR_UNSUPPORTED_DTYPE, "bias", a->bias.dtype, t, a->upcast));
  /* Rows: every present row operand has x's row count; gate and residual_out need y. */
  if (!ltx_valid_rows(&a->x)) return malformed("x");
  rows = ltx_num_rows(&a->x);
  LTX_RETURN_IF_FAILED(rows_like("out", &a->out, "x", rows));
  LTX_RETURN_IF_FAILED(optional_rows_like("y", &a->y, "x", rows));
  for (i = 0; i < 3; ++i)
    LTX_RETURN_IF_FAILED(optional_rows_like(modulation_names[i], modulation[i], "x", rows));
  LTX_RETURN_IF_FAILED(optional_rows_like("residual_out", &a->residual_out, "x", rows));
  if (a->gate.data && !a->y.data)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "gate", "y");
  if (a->residual_out.data && !a->y.data)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "residual_out", "y");
  /* The norm; a bias only with LayerNorm. */
  if (a->norm != LTX_NORM_RMS && a->norm != LTX_NORM_LAYER) return malformed("norm");
  if (a->bias.data && a->norm != LTX_NORM_LAYER)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "bias", "norm");
  if (a->hidden < 0) return malformed("hidden");
  return eps_rule(a->eps);
}

ltx_check_t ltx_check_norm_backward(const ltx_norm_backward_args_t* a) {
  const ltx_rows_t* ref;
  const char* ref_name;
  ltx_dtype_t t;
  int64_t rows;
  int i;
  if (!a) return malformed("args");
  /* The rows: h with a norm (dout given), else dh_out (gated_residual). */
  if (a->dout.data && !a->h.data)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "dout", "h");
  if (!a->dout.data && !a->dh_out.data) return malformed("dh_out");
  ref = a->dout.data ? &a->h : &a->dh_out;
  ref_name = a->dout.data ? "h" : "dh_out";
  t = ref->dtype;
  LTX_RETURN_IF_FAILED(float_or_float64_dtype(ref_name, t));
  {
    const char* const names[6] = {"dout", "dh_out", "y", "dx", "dy", "h"};
    const ltx_rows_t* const activations[6] = {&a->dout, &a->dh_out, &a->y, &a->dx, &a->dy, &a->h};
    for (i = 0; i < 6; ++i)
      if (activations[i]->data)
        LTX_RETURN_IF_FAILED(
            dtype_of(LTX_ERR_INVALID_ARGUMENT, names[i], activations[i]->dtype, ref_name, t));
  }
  /* gate and scale: T or fp32, one dtype; their per-row gradients have their dtype. */
  if (a->gate.data)
    LTX_RETURN_IF_FAILED(operand_dtype(LTX_ERR_UNSUPPORTED_DTYPE, "gate", a->gate.dtype, t, 1));
  if (a->scale.data)
    LTX_RETURN_IF_FAILED(operand_dtype(LTX_ERR_UNSUPPORTED_DTYPE, "scale", a->scale.dtype, t, 1));
  if (a->gate.data && a->scale.data && a->gate.dtype != a->scale.dtype)
    return dtype_fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SAME_DTYPE_AS, "gate", a->gate.dtype,
                      "scale", a->scale.dtype);
  if (a->dscale.data && !a->scale.data)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "dscale", "scale");
  if (a->dgate.data && !a->gate.data)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "dgate", "gate");
  if (a->dscale.data)
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_INVALID_ARGUMENT, "dscale", a->dscale.dtype, "scale", a->scale.dtype));
  if (a->dgate.data)
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_INVALID_ARGUMENT, "dgate", a->dgate.dtype, "gate", a->gate.dtype));
  if (a->weight.data)
    LTX_RETURN_IF_FAILED(operand_dtype(LTX_ERR_UNSUPPORTED_DTYPE, "weight", a->weight.dtype, t, 1));
  if (a->bias.data)
    LTX_RETURN_IF_FAILED(operand_dtype(LTX_ERR_UNSUPPORTED_DTYPE, "bias", a->bias.dtype, t, 1));
  /* Rows: every present row operand has the rows of ref. */
  if (!ltx_valid_rows(ref)) return malformed(ref_name);
  rows = ltx_num_rows(ref);
  {
    const char* const names[9] = {"h",     "dout", "dh_out", "y",     "gate",
                                  "scale", "dx",   "dy",     "dscale"};
    const ltx_rows_t* const operands[9] = {&a->h,     &a->dout, &a->dh_out, &a->y,     &a->gate,
                                           &a->scale, &a->dx,   &a->dy,     &a->dscale};
    for (i = 0; i < 9; ++i)
      LTX_RETURN_IF_FAILED(optional_rows_like(names[i], operands[i], ref_name, rows));
    LTX_RETURN_IF_FAILED(optional_rows_like("dgate", &a->dgate, ref_name, rows));
  }
  /* What each output needs: the norm's gradients dout; dgate y. */
  {
    const char* const names[7] = {"scale",      "weight",      "bias",     "dscale",
                                  "dscale_sum", "dweight_sum", "dbias_sum"};
    const int present[7] = {a->scale.data != NULL,  a->weight.data != NULL, a->bias.data != NULL,
                            a->dscale.data != NULL, a->dscale_sum != NULL,  a->dweight_sum != NULL,
                            a->dbias_sum != NULL};
    for (i = 0; i < 7; ++i)
      if (present[i] && !a->dout.data)
        return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, names[i], "dout");
    if (a->dshift_sum && !a->dout.data)
      return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "dshift_sum", "dout");
  }
  if ((a->dgate.data || a->dgate_sum) && !a->y.data)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, a->dgate.data ? "dgate" : "dgate_sum",
                "y");
  if (a->dscale.data && a->dscale_sum) return malformed("dscale_sum");
  if (a->dgate.data && a->dgate_sum) return malformed("dgate_sum");
  if (a->group_rows < 1 || (rows > 0 && rows % a->group_rows != 0)) return malformed("group_rows");
  if (a->chunk_rows < 1) return malformed("chunk_rows");
  if (a->norm != LTX_NORM_RMS && a->norm != LTX_NORM_LAYER) return malformed("norm");
  if (a->bias.data && a->norm != LTX_NORM_LAYER)
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, "bias", "norm");
  if (a->hidden < 0) return malformed("hidden");
  return a->dout.data ? eps_rule(a->eps) : ok();
}

ltx_check_t ltx_check_gated_residual(const ltx_rows_t* out, const ltx_rows_t* x,
                                     const ltx_rows_t* y, const ltx_rows_t* gate, int64_t hidden,
                                     int upcast) {
  const int64_t rows = ltx_num_rows(x);
  LTX_RETURN_IF_FAILED(float_or_float64_dtype("x", x->dtype));
  if (gate->data) LTX_RETURN_IF_FAILED(float_or_float64_dtype("gate", gate->dtype));
  LTX_RETURN_IF_FAILED(dtype_of(LTX_ERR_INVALID_ARGUMENT, "y", y->dtype, "x", x->dtype));
  LTX_RETURN_IF_FAILED(dtype_of(LTX_ERR_INVALID_ARGUMENT, "out", out->dtype, "x", x->dtype));
  if (upcast != 0 && upcast != 1) return malformed("upcast");
  /* The gate is T, or fp32 when the product is kept in fp32 (upcast). */
  if (gate->data)
    LTX_RETURN_IF_FAILED(
        operand_dtype(LTX_ERR_INVALID_ARGUMENT, "gate", gate->dtype, x->dtype, upcast));
  if (!ltx_valid_rows(x)) return malformed("x");
  LTX_RETURN_IF_FAILED(rows_like("y", y, "x", rows));
  LTX_RETURN_IF_FAILED(optional_rows_like("gate", gate, "x", rows));
  LTX_RETURN_IF_FAILED(rows_like("out", out, "x", rows));
  if (hidden < 0) return malformed("hidden");
  return ok();
}

/* The launcher names of the fields of tensors[0] and tensors[1]. */
static const char* const kTensorX[2] = {"tensors[0].x", "tensors[1].x"};
static const char* const kTensorOut[2] = {"tensors[0].out", "tensors[1].out"};
static const char* const kTensorCos[2] = {"tensors[0].cos", "tensors[1].cos"};
static const char* const kTensorSin[2] = {"tensors[0].sin", "tensors[1].sin"};
static const char* const kTensorWeight[2] = {"tensors[0].weight", "tensors[1].weight"};

/* The rules of ltx_qk_norm_rope (and of its backward, with the gradients as out). */
static ltx_check_t check_qk_norm_rope(const ltx_qk_norm_rope_args_t* a) {
  ltx_dtype_t t;
  const ltx_rope_tensor_t* table_tensor = NULL; /* the first tensor with cos/sin */
  int k;
  if (!a) return malformed("args");
  if (a->num_tensors != 1 && a->num_tensors != 2) return malformed("num_tensors");
  if (a->heads < 0) return malformed("heads");
  if (a->head_dim < 0 || (a->head_dim > 0 && a->heads > INT64_MAX / a->head_dim))
    return malformed("head_dim");
  if (a->normalize) LTX_RETURN_IF_FAILED(eps_rule(a->eps));
  /* Dtypes: x and out of both tensors T; cos and sin one dtype for both tensors, T or fp32;
   * weights T or fp32. */
  t = a->tensors[0].x.dtype;
  LTX_RETURN_IF_FAILED(float_or_float64_dtype(kTensorX[0], t));
  if (a->quant.format != LTX_QUANT_NONE) { /* tensor 0's out quantized per head */
    LTX_RETURN_IF_FAILED(float_dtype(kTensorX[0], t));
    LTX_RETURN_IF_FAILED(quantized_groups(&a->tensors[0].out, &a->quant,
                                          ltx_num_rows(&a->tensors[0].x), a->head_dim));
  }
  for (k = 0; k < a->num_tensors; ++k) {
    const ltx_rope_tensor_t* r = &a->tensors[k];
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_UNSUPPORTED_DTYPE, kTensorX[k], r->x.dtype, kTensorX[0], t));
    if (k > 0 || a->quant.format == LTX_QUANT_NONE)
      LTX_RETURN_IF_FAILED(
          dtype_of(LTX_ERR_INVALID_ARGUMENT, kTensorOut[k], r->out.dtype, kTensorX[k], r->x.dtype));
    if ((r->cos.data == NULL) != (r->sin.data == NULL))
      return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES,
                  r->cos.data ? kTensorCos[k] : kTensorSin[k],
                  r->cos.data ? kTensorSin[k] : kTensorCos[k]);
    if (r->cos.data) {
      if (r->sin.dtype != r->cos.dtype)
        return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_SAME_DTYPE_AS, kTensorSin[k],
                          r->sin.dtype, kTensorCos[k], r->cos.dtype);
      if (r->cos.dtype != t && r->cos.dtype != LTX_FLOAT32)
        return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_DTYPE_OF_OR_FLOAT32, kTensorCos[k],
                          r->cos.dtype, kTensorX[0], t);
      if (table_tensor && r->cos.dtype != table_tensor->cos.dtype)
        return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_SAME_DTYPE_AS, kTensorCos[k],
                          r->cos.dtype, kTensorCos[0], table_tensor->cos.dtype);
      if (!table_tensor) table_tensor = r;
    }
    if (a->normalize && r->weight.data && r->weight.dtype != t && r->weight.dtype != LTX_FLOAT32)
      return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_DTYPE_OF_OR_FLOAT32, kTensorWeight[k],
                        r->weight.dtype, kTensorX[0], t);
  }
  /* Rows: out, cos and sin have x's rows. Rotation: an even head_dim; interleaved pairs span the
   * head, halves span it or half of it. */
  for (k = 0; k < a->num_tensors; ++k) {
    const ltx_rope_tensor_t* r = &a->tensors[k];
    const int64_t rows = ltx_num_rows(&r->x);
    if (!ltx_valid_rows(&r->x)) return malformed(kTensorX[k]);
    LTX_RETURN_IF_FAILED(rows_like(kTensorOut[k], &r->out, kTensorX[k], rows));
    LTX_RETURN_IF_FAILED(optional_rows_like(kTensorCos[k], &r->cos, kTensorX[k], rows));
    LTX_RETURN_IF_FAILED(optional_rows_like(kTensorSin[k], &r->sin, kTensorX[k], rows));
  }
  if (table_tensor && a->head_dim % 2 != 0) {
    const ltx_check_t c = {.status = LTX_ERR_INVALID_ARGUMENT,
                           .rule = LTX_RULE_EVEN_HEAD_DIM,
                           .arg = "head_dim",
                           .value = (double)a->head_dim};
    return c;
  }
  if (table_tensor && a->rot_dim != a->head_dim &&
      !(!a->interleaved && 2 * a->rot_dim == a->head_dim)) {
    const ltx_check_t c = {.status = LTX_ERR_INVALID_ARGUMENT,
                           .rule = a->interleaved ? LTX_RULE_ROT_DIM : LTX_RULE_ROT_DIM_OR_HALF,
                           .arg = "rot_dim",
                           .ref = "head_dim",
                           .value = (double)a->rot_dim,
                           .expected = a->head_dim};
    return c;
  }
  return ok();
}

ltx_check_t ltx_check_qk_norm_rope(const ltx_qk_norm_rope_args_t* a) {
  return check_qk_norm_rope(a);
}

static const char* const kGrad[2] = {"grad[0]", "grad[1]"};
static const char* const kWeightSum[2] = {"dweight_sum[0]", "dweight_sum[1]"};

ltx_check_t ltx_check_qk_norm_rope_backward(const ltx_qk_norm_rope_backward_args_t* a) {
  int k;
  if (!a) return malformed("args");
  /* The forward's rules (out: the gradient dx), then each grad: x's dtype and rows; a weight
   * gradient needs the norm and its weight. */
  LTX_RETURN_IF_FAILED(check_qk_norm_rope(&a->forward));
  if (a->forward.quant.format != LTX_QUANT_NONE) return malformed("forward.quant");
  if (a->chunk_rows < 1) return malformed("chunk_rows");
  for (k = 0; k < a->forward.num_tensors; ++k) {
    const ltx_rope_tensor_t* r = &a->forward.tensors[k];
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_INVALID_ARGUMENT, kGrad[k], a->grad[k].dtype, kTensorX[k], r->x.dtype));
    LTX_RETURN_IF_FAILED(rows_like(kGrad[k], &a->grad[k], kTensorX[k], ltx_num_rows(&r->x)));
    if (a->dweight_sum[k] && !(a->forward.normalize && r->weight.data))
      return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_REQUIRES, kWeightSum[k], kTensorWeight[k]);
  }
  return ok();
}

ltx_check_t ltx_check_gelu(const ltx_rows_t* out, const ltx_rows_t* x, int64_t hidden,
                           ltx_gelu_approximate_t approximate, int gated) {
  LTX_RETURN_IF_FAILED(float_or_float64_dtype("x", x->dtype));
  LTX_RETURN_IF_FAILED(dtype_of(LTX_ERR_INVALID_ARGUMENT, "out", out->dtype, "x", x->dtype));
  if (!ltx_valid_rows(x)) return malformed("x");
  LTX_RETURN_IF_FAILED(rows_like("out", out, "x", ltx_num_rows(x)));
  if (hidden < 0 || hidden > INT64_MAX / 2) return malformed("hidden"); /* gated rows: 2 * hidden */
  if (approximate != LTX_GELU_NONE && approximate != LTX_GELU_TANH) return malformed("approximate");
  if (gated != 0 && gated != 1) return malformed("gated");
  return ok();
}

ltx_check_t ltx_check_gelu_backward(const ltx_rows_t* dx, const ltx_rows_t* dout,
                                    const ltx_rows_t* x, int64_t hidden,
                                    ltx_gelu_approximate_t approximate, int gated) {
  /* The forward's rules with dx as its output, then dout: x's dtype and rows. */
  LTX_RETURN_IF_FAILED(ltx_check_gelu(dx, x, hidden, approximate, gated));
  LTX_RETURN_IF_FAILED(dtype_of(LTX_ERR_INVALID_ARGUMENT, "dout", dout->dtype, "x", x->dtype));
  return rows_like("dout", dout, "x", ltx_num_rows(x));
}

ltx_check_t ltx_check_quantize(const ltx_rows_t* out, const ltx_quant_t* quant, const ltx_rows_t* x,
                               int64_t hidden, ltx_activation_t activation,
                               ltx_gelu_approximate_t approximate) {
  LTX_RETURN_IF_FAILED(float_dtype("x", x->dtype));
  if (!ltx_valid_rows(x)) return malformed("x");
  LTX_RETURN_IF_FAILED(quantized_output(out, quant, ltx_num_rows(x)));
  LTX_RETURN_IF_FAILED(rows_like("out", out, "x", ltx_num_rows(x)));
  if (hidden < 0) return malformed("hidden");
  if (activation != LTX_ACTIVATION_NONE && activation != LTX_ACTIVATION_GELU)
    return malformed("activation");
  if (approximate != LTX_GELU_NONE && approximate != LTX_GELU_TANH) return malformed("approximate");
  return ok();
}

/* arg, an optional index vector (data NULL: absent), is int32 or int64. */
static ltx_check_t index_vector_dtype(const char* arg, const ltx_vector_t* v) {
  if (!v->data || v->dtype == LTX_INT32 || v->dtype == LTX_INT64) return ok();
  return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_INDEX_DTYPE, arg, v->dtype, NULL, v->dtype);
}

/* arg is finite (NaN is not). */
static ltx_check_t finite_value(const char* arg, double value) {
  if (value > -INFINITY && value < INFINITY) return ok();
  const ltx_check_t c = {
      .status = LTX_ERR_INVALID_ARGUMENT, .rule = LTX_RULE_FINITE, .arg = arg, .value = value};
  return c;
}

/* attention: q, k, v, out of one dtype T; out q's sizes, k q's batch and heads, v k's sizes. */
ltx_check_t ltx_check_attention(const ltx_attention_args_t* a) {
  const char* const names[3] = {"k", "v", "out"};
  const ltx_rows_t* operands[3];
  int i;
  if (!a) return malformed("args");
  operands[0] = &a->k;
  operands[1] = &a->v;
  operands[2] = &a->out;
  LTX_RETURN_IF_FAILED(float_or_float64_dtype("q", a->q.dtype));
  for (i = 0; i < 3; ++i)
    LTX_RETURN_IF_FAILED(
        dtype_of(LTX_ERR_INVALID_ARGUMENT, names[i], operands[i]->dtype, "q", a->q.dtype));
  LTX_RETURN_IF_FAILED(index_vector_dtype("key_lengths", &a->key_lengths));
  if (!ltx_valid_rows(&a->q)) return malformed("q");
  for (i = 0; i < 3; ++i)
    if (!ltx_valid_rows(operands[i])) return malformed(names[i]);
  if (a->k.size[0] != a->q.size[0] || a->k.size[2] != a->q.size[2])
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SHAPE_OF, "k", "q");
  for (i = 0; i < LTX_MAX_ROW_DIMS; ++i) {
    if (a->v.size[i] != a->k.size[i])
      return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SHAPE_OF, "v", "k");
    if (a->out.size[i] != a->q.size[i])
      return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SHAPE_OF, "out", "q");
  }
  if (a->head_dim < 0) return malformed("head_dim");
  return finite_value("scale", a->scale);
}

/* attention_int8: q8, k8 int8 and v8 float8_e4m3 codes, out float (or float64); k8 q8's batch and
 * heads, v8 {batch, heads, head_dim} rows of kv_pad >= ltx_attention_v_pad(kv_len) columns (the
 * permuted columns of keys below kv_len), out q8's sizes; the scales
 * present (their sizes follow from the rows'). */
ltx_check_t ltx_check_attention_int8(const ltx_attention_int8_args_t* a) {
  const char* const names[4] = {"q8", "k8", "v8", "out"};
  const ltx_rows_t* operands[4];
  const ltx_dtype_t dtypes[3] = {LTX_INT8, LTX_INT8, LTX_FLOAT8_E4M3};
  int i;
  if (!a) return malformed("args");
  operands[0] = &a->q8;
  operands[1] = &a->k8;
  operands[2] = &a->v8;
  operands[3] = &a->out;
  LTX_RETURN_IF_FAILED(float_or_float64_dtype("out", a->out.dtype));
  for (i = 0; i < 3; ++i)
    if (operands[i]->dtype != dtypes[i])
      return dtype_fail(LTX_ERR_UNSUPPORTED_DTYPE, LTX_RULE_CODE_DTYPE, names[i],
                        operands[i]->dtype, NULL, dtypes[i]);
  LTX_RETURN_IF_FAILED(index_vector_dtype("key_lengths", &a->key_lengths));
  for (i = 0; i < 4; ++i)
    if (!ltx_valid_rows(operands[i])) return malformed(names[i]);
  if (a->k8.size[0] != a->q8.size[0] || a->k8.size[2] != a->q8.size[2])
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SHAPE_OF, "k8", "q8");
  if (a->v8.size[0] != a->q8.size[0] || a->v8.size[1] != a->q8.size[2] ||
      a->v8.size[2] != a->head_dim || a->kv_pad < ltx_attention_v_pad(a->k8.size[1]))
    return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SHAPE_OF, "v8", "k8");
  for (i = 0; i < LTX_MAX_ROW_DIMS; ++i)
    if (a->out.size[i] != a->q8.size[i])
      return fail(LTX_ERR_INVALID_ARGUMENT, LTX_RULE_SHAPE_OF, "out", "q8");
  if (a->head_dim < 0) return malformed("head_dim");
  if (ltx_num_rows(&a->q8) > 0 && !a->q_scale) return malformed("q_scale");
  if (ltx_num_rows(&a->k8) > 0 && !a->k_scale) return malformed("k_scale");
  if (ltx_num_rows(&a->v8) > 0 && !a->v_scale) return malformed("v_scale");
  return finite_value("scale", a->scale);
}

/* quantize_attention_k/v: x a model dtype with {batch, kv_len, heads} rows, codes of the op's
 * dtype, scale (and codes, unless there is nothing to write) present. */
static ltx_check_t attention_quant(const ltx_attention_quant_args_t* a, ltx_dtype_t codes_dtype) {
  if (!a) return malformed("args");
  LTX_RETURN_IF_FAILED(float_dtype("x", a->x.dtype));
  if (!ltx_valid_rows(&a->x)) return malformed("x");
  if (a->codes_dtype != codes_dtype) return malformed("codes_dtype");
  if (a->head_dim < 0) return malformed("head_dim");
  if (ltx_num_rows(&a->x) > 0 && a->head_dim > 0 && (!a->codes || !a->scale))
    return malformed(!a->codes ? "codes" : "scale");
  return ok();
}

ltx_check_t ltx_check_quantize_attention_k(const ltx_attention_quant_args_t* args) {
  return attention_quant(args, LTX_INT8);
}

ltx_check_t ltx_check_quantize_attention_v(const ltx_attention_quant_args_t* args) {
  return attention_quant(args, LTX_FLOAT8_E4M3);
}
