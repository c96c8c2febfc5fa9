// The ltx_kernels op library: the schema of every op, in one table. Each op has one impl for both
// backends (norm_ops.cpp, rope_ops.cpp, elementwise_ops.cpp, attention_ops.cpp): it checks what is
// torch's, allocates the outputs and runs the C launchers through run_launcher (binding_utils.h).
// Meta comes from the fake implementations in _fake.py; ltx_kernels.reference has each op's exact
// formula.
#include "torch_binding.h"

#include "ltx_registration.h"

TORCH_LIBRARY_EXPAND(LTX_OPS_NAMESPACE, ops) {
  const auto def = [&](const char* schema, const char* name, auto fn) {
    ops.def(schema);
    ops.impl(name, c10::kCPU, fn);
#if defined(CUDA_KERNEL)
    ops.impl(name, c10::kCUDA, fn);
#endif
  };
  // y = x * rsqrt(mean(x^2, -1) + eps) [* weight], rounded as diffusers' RMSNorm; out dtype is
  // weight's (x's without weight).
  def("rmsnorm(Tensor x, Tensor? weight=None, float eps=1e-06) -> Tensor", "rmsnorm", &rmsnorm);
  // RMSNorm [* weight] then AdaLN modulation: n * (1 + scale) + shift.
  def("rmsnorm_modulate(Tensor x, Tensor? scale, Tensor? shift, Tensor? weight=None, "
      "float eps=1e-06, *, bool upcast=False) -> Tensor",
      "rmsnorm_modulate", &rmsnorm_modulate);
  // LayerNorm [* weight + bias] then AdaLN modulation.
  def("layernorm_modulate(Tensor x, Tensor? scale, Tensor? shift, Tensor? weight=None, "
      "Tensor? bias=None, float eps=1e-06, *, bool upcast=False) -> Tensor",
      "layernorm_modulate", &layernorm_modulate);
  // h = x + y [* gate], then rmsnorm_modulate of h; returns (h, n).
  def("add_rmsnorm_modulate(Tensor x, Tensor y, Tensor? scale, Tensor? shift, "
      "Tensor? gate=None, Tensor? weight=None, float eps=1e-06, *, bool upcast=False) "
      "-> (Tensor, Tensor)",
      "add_rmsnorm_modulate", &add_rmsnorm_modulate);
  // h = x + y [* gate], then layernorm_modulate of h; returns (h, n).
  def("add_layernorm_modulate(Tensor x, Tensor y, Tensor? scale, Tensor? shift, "
      "Tensor? gate=None, Tensor? weight=None, Tensor? bias=None, float eps=1e-06, *, "
      "bool upcast=False) -> (Tensor, Tensor)",
      "add_layernorm_modulate", &add_layernorm_modulate);
  // out = x + y * gate (x + y without gate).
  def("gated_residual(Tensor x, Tensor y, Tensor? gate=None, *, bool upcast=False) -> Tensor",
      "gated_residual", &gated_residual);
  // Rotary embedding of x with cos/sin tables (interleaved pairs or rotate-halves).
  def("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved=True) -> Tensor", "rope", &rope);
  // RMSNorm of q and k (over each head, or across heads) [* weights], then their rotation.
  def("qk_rmsnorm_rope(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor? cos, "
      "Tensor? sin, float eps=1e-06, bool across_heads=True, bool interleaved=True) "
      "-> (Tensor, Tensor)",
      "qk_rmsnorm_rope", &qk_rmsnorm_rope);
  // GELU, erf ('none', F.gelu's default) or tanh form.
  def("gelu(Tensor x, str approximate='none') -> Tensor", "gelu", &gelu);
  // GEGLU as diffusers': hidden, gate = x.chunk(2, -1); hidden * gelu(gate).
  def("geglu(Tensor x, str approximate='none') -> Tensor", "geglu", &geglu);
  // Quantized-output ops (inference): the op's value quantized in `format` (ltx_kernels.h,
  // Quantized outputs; 'e4m3_row': float8_e4m3fn with one fp32 scale per row, x.shape[:-1]);
  // returns (codes, scales), after h for the add_ ones.
  def("rmsnorm_modulate_quant(Tensor x, Tensor? scale, Tensor? shift, Tensor? weight=None, "
      "float eps=1e-06, *, bool upcast=False, str format='e4m3_row') -> (Tensor, Tensor)",
      "rmsnorm_modulate_quant", &rmsnorm_modulate_quant);
  def("layernorm_modulate_quant(Tensor x, Tensor? scale, Tensor? shift, Tensor? weight=None, "
      "Tensor? bias=None, float eps=1e-06, *, bool upcast=False, str format='e4m3_row') "
      "-> (Tensor, Tensor)",
      "layernorm_modulate_quant", &layernorm_modulate_quant);
  def("add_rmsnorm_modulate_quant(Tensor x, Tensor y, Tensor? scale, Tensor? shift, "
      "Tensor? gate=None, Tensor? weight=None, float eps=1e-06, *, bool upcast=False, "
      "str format='e4m3_row') -> (Tensor, Tensor, Tensor)",
      "add_rmsnorm_modulate_quant", &add_rmsnorm_modulate_quant);
  def("add_layernorm_modulate_quant(Tensor x, Tensor y, Tensor? scale, Tensor? shift, "
      "Tensor? gate=None, Tensor? weight=None, Tensor? bias=None, float eps=1e-06, *, "
      "bool upcast=False, str format='e4m3_row') -> (Tensor, Tensor, Tensor)",
      "add_layernorm_modulate_quant", &add_layernorm_modulate_quant);
  // x, or gelu(x, approximate) rounded to x's dtype (activation 'gelu'), quantized in `format`.
  def("quantize(Tensor x, str activation='none', str approximate='none', *, "
      "str format='e4m3_row') -> (Tensor, Tensor)",
      "quantize", &quantize);
  // qk_rmsnorm_rope with q's output quantized per head in `format`: (q codes, q scales [..., H]
  // of a [..., H, Dh] q, k).
  def("qk_rmsnorm_rope_quant(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor? cos, "
      "Tensor? sin, float eps=1e-06, bool across_heads=True, bool interleaved=True, *, "
      "str format='i8_row') -> (Tensor, Tensor, Tensor)",
      "qk_rmsnorm_rope_quant", &qk_rmsnorm_rope_quant);
  // Softmax attention (non-causal) of q [B, Sq, H, D] over k, v [B, Sk, H, D], each batch element
  // over its first key_lengths[b] keys; returns (out [B, Sq, H, D], lse [B, H, Sq] or empty).
  def("attention(Tensor q, Tensor k, Tensor v, Tensor? key_lengths=None, float? scale=None, *, "
      "bool return_lse=False) -> (Tensor, Tensor)",
      "attention", &attention);
  // attention over 8-bit operands: q8, k8 int8 [B, S, H, D] with q_scale [B, Sq, H] and k_scale
  // [B, H, ceil(Sk / 128)], v8 e4m3 transposed [B, H, D, Sk rounded up to 16] (keys in
  // ltx_attention_v_column order) with v_scale [B, H, D]; returns (out [B, Sq, H, D] in out_dtype
  // (default bfloat16), lse or empty).
  def("attention_int8(Tensor q8, Tensor q_scale, Tensor k8, Tensor k_scale, Tensor v8, "
      "Tensor v_scale, Tensor? key_lengths=None, float? scale=None, *, ScalarType? out_dtype=None, "
      "bool return_lse=False) -> (Tensor, Tensor)",
      "attention_int8", &attention_int8);
  // The 8-bit attention operands of k [B, S, H, D]: k minus its per-(batch, head) mean over the
  // sequence, int8 [B, S, H, D] with one fp32 scale per head and block of 128 keys [B, H, S/128].
  def("quantize_attention_k(Tensor k) -> (Tensor, Tensor)", "quantize_attention_k",
      &quantize_attention_k);
  // ... of v [B, S, H, D]: e4m3 transposed [B, H, D, S padded to 16] with one fp32 scale per
  // channel [B, H, D].
  def("quantize_attention_v(Tensor v) -> (Tensor, Tensor)", "quantize_attention_v",
      &quantize_attention_v);
  // Backward ops (functional; the autograd of the ops above calls them, _autograd.py).
  // The gradient of x for gelu's output gradient (x's shape and dtype).
  def("gelu_backward(Tensor grad_out, Tensor x, str approximate='none') -> Tensor", "gelu_backward",
      &gelu_backward);
  // The gradient of x = [hidden | gate] for geglu's output gradient.
  def("geglu_backward(Tensor grad_out, Tensor x, str approximate='none') -> Tensor",
      "geglu_backward", &geglu_backward);
  // The gradients (x, y, gate, scale, shift, weight, bias) of the norm ops and gated_residual for
  // the gradients of their outputs n (grad_out) and h (grad_h); h: the normalized rows. Gradients
  // not asked for (output_mask) are empty.
  def("norm_modulate_backward(Tensor? grad_out, Tensor? grad_h, Tensor? h, Tensor? y, "
      "Tensor? gate, Tensor? scale, Tensor? shift, Tensor? weight, Tensor? bias, float eps, "
      "bool layer_norm, bool[7] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)",
      "norm_modulate_backward", &norm_modulate_backward);
  // The gradient of rope's x for its output gradient (the transposed rotation).
  def("rope_backward(Tensor grad_out, Tensor cos, Tensor sin, bool interleaved=True) -> Tensor",
      "rope_backward", &rope_backward);
  // The gradients (q, k, q_weight, k_weight) of qk_rmsnorm_rope for the gradients of its outputs;
  // the weights' only where weight_grads asks (else empty).
  def("qk_rmsnorm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor q, Tensor k, "
      "Tensor? q_weight, Tensor? k_weight, Tensor? cos, Tensor? sin, float eps, bool across_heads, "
      "bool interleaved, bool[2] weight_grads) -> (Tensor, Tensor, Tensor, Tensor)",
      "qk_rmsnorm_rope_backward", &qk_rmsnorm_rope_backward);
  // gelu(x @ weight.T + bias), tanh form: one cuBLASLt GEMM with a GELU epilogue.
  def("linear_gelu(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", "linear_gelu",
      &linear_gelu);
  // x @ weight.T + bias plus LoRA updates: scaling[j] * (x @ lora_a[j].T) @ lora_b[j].T added to
  // output columns offsets[j]... (peft's LoRA Linear; several projections of x in one weight).
  def("lora_linear(Tensor x, Tensor weight, Tensor? bias, Tensor[] lora_a, Tensor[] lora_b, "
      "float[] scaling, int[] offsets) -> Tensor",
      "lora_linear", &lora_linear);
  // Training memory (integration/recompute.py): while on, the norm ops and single LoRA
  // projections record their outputs, which lora_linear and qk_rmsnorm_rope then save as the call
  // that gives them again (autograd_ops.cpp). No tensors: one kernel for every backend.
  ops.def("recompute_scope(bool on) -> ()",
          torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &recompute_scope));
}

REGISTER_EXTENSION(TORCH_EXTENSION_NAME)
