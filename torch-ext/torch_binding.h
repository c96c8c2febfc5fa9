// Entry points of the ltx_kernels ops (torch side), one impl per op for both backends (CPU and
// CUDA): torch's checks, output allocation, then the C launchers of kernel_src/ltx_kernels.h (the
// GEMM ops of linear_ops.cpp: libtorch's GEMMs).
#pragma once

#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

// norm_ops.cpp
at::Tensor rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps);
at::Tensor rmsnorm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                            const std::optional<at::Tensor>& shift,
                            const std::optional<at::Tensor>& weight, double eps, bool upcast);
at::Tensor layernorm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& scale,
                              const std::optional<at::Tensor>& shift,
                              const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias, double eps, bool upcast);
std::tuple<at::Tensor, at::Tensor> add_rmsnorm_modulate(const at::Tensor& x, const at::Tensor& y,
                                                        const std::optional<at::Tensor>& scale,
                                                        const std::optional<at::Tensor>& shift,
                                                        const std::optional<at::Tensor>& gate,
                                                        const std::optional<at::Tensor>& weight,
                                                        double eps, bool upcast);
std::tuple<at::Tensor, at::Tensor> add_layernorm_modulate(const at::Tensor& x, const at::Tensor& y,
                                                          const std::optional<at::Tensor>& scale,
                                                          const std::optional<at::Tensor>& shift,
                                                          const std::optional<at::Tensor>& gate,
                                                          const std::optional<at::Tensor>& weight,
                                                          const std::optional<at::Tensor>& bias,
                                                          double eps, bool upcast);
std::tuple<at::Tensor, at::Tensor> rmsnorm_modulate_quant(const at::Tensor& x,
                                                          const std::optional<at::Tensor>& scale,
                                                          const std::optional<at::Tensor>& shift,
                                                          const std::optional<at::Tensor>& weight,
                                                          double eps, bool upcast,
                                                          c10::string_view format);
std::tuple<at::Tensor, at::Tensor> layernorm_modulate_quant(
    const at::Tensor& x, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool upcast, c10::string_view format);
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rmsnorm_modulate_quant(
    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& gate,
    const std::optional<at::Tensor>& weight, double eps, bool upcast, c10::string_view format);
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_layernorm_modulate_quant(
    const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& gate,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool upcast, c10::string_view format);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
norm_modulate_backward(const std::optional<at::Tensor>& grad_out,
                       const std::optional<at::Tensor>& grad_h, const std::optional<at::Tensor>& h,
                       const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& gate,
                       const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& shift,
                       const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, double eps, bool layer_norm,
                       std::array<bool, 7> output_mask);
// rope_ops.cpp
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                bool interleaved);
std::tuple<at::Tensor, at::Tensor> qk_rmsnorm_rope(const at::Tensor& q, const at::Tensor& k,
                                                   const std::optional<at::Tensor>& q_weight,
                                                   const std::optional<at::Tensor>& k_weight,
                                                   const std::optional<at::Tensor>& cos,
                                                   const std::optional<at::Tensor>& sin, double eps,
                                                   bool across_heads, bool interleaved);
std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_rmsnorm_rope_quant(
    const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& q_weight,
    const std::optional<at::Tensor>& k_weight, const std::optional<at::Tensor>& cos,
    const std::optional<at::Tensor>& sin, double eps, bool across_heads, bool interleaved,
    c10::string_view format);
at::Tensor rope_backward(const at::Tensor& grad_out, const at::Tensor& cos, const at::Tensor& sin,
                         bool interleaved);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> qk_rmsnorm_rope_backward(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& q, const at::Tensor& k,
    const std::optional<at::Tensor>& q_weight, const std::optional<at::Tensor>& k_weight,
    const std::optional<at::Tensor>& cos, const std::optional<at::Tensor>& sin, double eps,
    bool across_heads, bool interleaved, std::array<bool, 2> weight_grads);
// elementwise_ops.cpp
at::Tensor gated_residual(const at::Tensor& x, const at::Tensor& y,
                          const std::optional<at::Tensor>& gate, bool upcast);
at::Tensor gelu(const at::Tensor& x, c10::string_view approximate);
at::Tensor geglu(const at::Tensor& x, c10::string_view approximate);
at::Tensor gelu_backward(const at::Tensor& grad_out, const at::Tensor& x,
                         c10::string_view approximate);
at::Tensor geglu_backward(const at::Tensor& grad_out, const at::Tensor& x,
                          c10::string_view approximate);
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, c10::string_view activation,
                                            c10::string_view approximate, c10::string_view format);

// attention_ops.cpp
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v,
                                             const std::optional<at::Tensor>& key_lengths,
                                             std::optional<double> scale, bool return_lse);
std::tuple<at::Tensor, at::Tensor> attention_int8(const at::Tensor& q8, const at::Tensor& q_scale,
                                                  const at::Tensor& k8, const at::Tensor& k_scale,
                                                  const at::Tensor& v8, const at::Tensor& v_scale,
                                                  const std::optional<at::Tensor>& key_lengths,
                                                  std::optional<double> scale,
                                                  std::optional<at::ScalarType> out_dtype,
                                                  bool return_lse);
std::tuple<at::Tensor, at::Tensor> quantize_attention_k(const at::Tensor& k);
std::tuple<at::Tensor, at::Tensor> quantize_attention_v(const at::Tensor& v);

// linear_ops.cpp
at::Tensor linear_gelu(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias);
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::TensorList lora_a,
                       at::TensorList lora_b, c10::ArrayRef<double> scaling,
                       c10::IntArrayRef offsets);
// t [..., K] as the rows of a GEMM, [M, K] with M the product of its leading dims, also when t is
// empty (reshape({-1, K}) cannot infer M from 0 elements); symbolic under torch.compile.
at::Tensor as_rows(const at::Tensor& t);
// The gradients of lora_linear (wanted: x, weight, bias, each lora_a, each lora_b), which its
// autograd (autograd_ops.cpp) returns.
std::vector<at::Tensor> lora_linear_backward(const at::Tensor& grad, const at::Tensor& x,
                                             const at::Tensor& weight, at::TensorList lora_a,
                                             at::TensorList lora_b, c10::ArrayRef<double> scaling,
                                             c10::IntArrayRef offsets,
                                             const std::vector<bool>& wanted);

// Turns on (a patched block's forward begins) or off (it ends) the recording of outputs that
// backward recomputes instead of saving them (autograd_ops.cpp, integration/recompute.py).
void recompute_scope(bool on);
