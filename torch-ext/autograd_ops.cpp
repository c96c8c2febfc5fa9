// Autograd of every op (the Autograd dispatch key), in C++: a call under autograd records one node
// whose backward calls the fused backward op, so an op costs the training step one dispatcher call
// forward and one backward (Python's custom-op autograd wrapper cost more host time than the ATen
// ops an op replaces). Under no_grad a call goes straight to the op's CPU or CUDA impl.
// - norm ops and gated_residual -> norm_modulate_backward: saves h (x, or the add_ ops' output),
//   the modulation tensors, weight, bias, and y only when gate's gradient is wanted;
// - rope -> rope_backward; qk_rmsnorm_rope -> qk_rmsnorm_rope_backward; gelu, geglu -> *_backward;
// - linear_gelu: the pre-activation recomputed with the forward's GEMM, then ATen's gelu_backward
//   and the three gradient GEMMs (cuBLAS), as PyTorch's own gelu(linear(x));
// - lora_linear: the GEMMs of lora_linear_backward (linear_ops.cpp), from the saved x, weight
//   and adapters.
// Inputs the fused kernels do not take (CUDA rows above their limit, an rmsnorm weight of another
// dtype than x, RoPE tables that require grad) take the VJP of the op's reference instead
// (reference_vjp, defined by _autograd.py). Only the gradients autograd asks for are computed.
// A backward with create_graph=True (second derivatives: gradgradcheck, gradient penalties) runs
// in grad mode and returns gradients that are differentiable again: instead of the fused backward
// ops, whose outputs are not, it evaluates the same VJP with differentiable ops (the norm ops:
// reference_vjp of the plain norm at the saved h and the residual's linear part in ATen; rope,
// qk_rmsnorm_rope: reference_vjp; gelu, geglu: ATen's GELU derivative; linear_gelu and lora_linear
// are ATen already). The first-order backward (grad mode off) is the fused path alone.
// The backward ops, the quantized ops and attention (no backward yet) record a node that raises
// when differentiated, naming the op. Training memory: within recompute_scope
// (integration/recompute.py), a norm output or a LoRA projection's output that lora_linear or
// qk_rmsnorm_rope saves is saved as the call that gives it again (the section "Outputs recomputed
// in backward" below).
#include <ATen/ExpandUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <array>
#include <functional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../kernel_src/ltx_kernels.h"
#include "ltx_registration.h"
#include "torch_binding.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// This library's op `name`, through the dispatcher (so that fake tensors, functionalization and
// torch.compile see every call).
template <class Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  const std::string qualified = std::string(STRINGIFY(LTX_OPS_NAMESPACE)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "").typed<Signature>();
}

// Calls op on the kernels below autograd (the op's CPU/CUDA impl, or its fake).
template <class Signature, class... Args>
auto call_below_autograd(const c10::TypedOperatorHandle<Signature>& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(std::forward<Args>(args)...);
}

bool requires_grad(const Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(const OptTensor& t) { return t.has_value() && requires_grad(*t); }
template <class... T>
bool recording(const T&... tensors) {
  return at::GradMode::is_enabled() && (requires_grad(tensors) || ...);
}

Tensor value_or_undefined(const OptTensor& t) { return t.has_value() ? *t : Tensor(); }
OptTensor optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// An output gradient as the kernels take it: a contiguous last dim (autograd may hand over
// expanded zeros or scalars). (Symbolic stride: under torch.compile(dynamic=True) a concrete
// stride would specialize the sequence length of the traced backward.)
Tensor rows(const Tensor& grad) {
  return !grad.defined() || grad.sym_stride(-1) == 1 ? grad : grad.contiguous();
}

// Bit i set when the i-th tensor argument of a Function's apply() is defined; autograd numbers
// the defined ones only (needs_input_grad's index).
template <class... T>
int64_t defined_mask(const T&... tensors) {
  int64_t mask = 0, bit = 1;
  ((mask |= (value_or_undefined(OptTensor(tensors)).defined() ? bit : 0), bit <<= 1), ...);
  return mask;
}

// needs_input_grad of the i-th tensor argument of apply().
bool needs(AutogradContext* ctx, int i) {
  const int64_t defined = ctx->saved_data["defined"].toInt();
  if (!((defined >> i) & 1)) return false;
  return ctx->needs_input_grad(__builtin_popcountll(defined & ((int64_t{1} << i) - 1)));
}

// The op reference_vjp (_autograd.reference_vjp): the gradients of op's tensors `inputs` (its
// _autograd.TENSOR_ORDER; undefined: absent) whose bit is set in `wanted`, for the gradients of its
// outputs; differentiable in grad mode (create_graph=True).
std::vector<Tensor> call_reference_vjp(const char* op, const variable_list& inputs,
                                       const variable_list& grads, int64_t wanted, double eps,
                                       bool upcast, bool across_heads, bool interleaved) {
  static const auto vjp =
      find_op<std::vector<Tensor>(c10::string_view, const c10::List<OptTensor>&,
                                  const c10::List<OptTensor>&, int64_t, double, bool, bool, bool)>(
          "reference_vjp");
  c10::List<OptTensor> saved, out_grads;
  for (const Tensor& t : inputs) saved.push_back(optional(t));
  for (const Tensor& g : grads) out_grads.push_back(optional(g));
  return vjp.call(op, saved, out_grads, wanted, eps, upcast, across_heads, interleaved);
}

// The VJP of the op's reference at the saved inputs, for the tensors of `inputs` (in the
// Function's order) whose gradients are asked for; the Function's other (non-tensor) arguments get
// none.
variable_list reference_vjp(AutogradContext* ctx, const char* op, const variable_list& inputs,
                            const variable_list& grads, int64_t num_other_arguments, double eps,
                            bool upcast, bool across_heads, bool interleaved) {
  int64_t wanted = 0;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (needs(ctx, static_cast<int>(i))) wanted |= int64_t{1} << i;
  const std::vector<Tensor> computed =
      call_reference_vjp(op, inputs, grads, wanted, eps, upcast, across_heads, interleaved);
  variable_list result(inputs.size() + num_other_arguments);
  for (size_t i = 0; i < inputs.size(); ++i)
    if ((wanted >> i) & 1) result[i] = computed[i];
  return result;
}

// ------------------------------------------------------------------------------------------------
// Outputs recomputed in backward instead of saved ("recompute_norms"; integration/recompute.py).
// While a patched block runs its forward in eager training (recompute_scope(true)), the norm ops
// record their output n, and lora_linear its output when it is one projection with its own
// adapter, with the call that gives it again below autograd, bit for bit (the same kernel on the
// same inputs; for the add_ ops, the plain norm op on their h). lora_linear's x and
// qk_rmsnorm_rope's q and k, when they are (views of) such an output, are saved as that call, which
// their backward runs (once per op that saved it). The call holds the tensors it reads: the norm's
// rows and modulation, which the norm's own node saves anyway; the projection's input and weights,
// which lora_linear's node saves anyway.
// t's version counter; -1 for an inference tensor (made under torch.inference_mode), which has
// none and cannot be written outside it.
int64_t version_of(const Tensor& t) { return t.is_inference() ? -1 : t._version(); }

struct Recompute final : torch::CustomClassHolder {
  const char* source;  // the op the call runs
  std::function<Tensor()> call;
  std::vector<Tensor> inputs;  // the call's tensors, not to be modified in place since
  std::vector<int64_t> versions;

  Tensor run(const char* op) const {
    for (size_t i = 0; i < inputs.size(); ++i)
      TORCH_CHECK(version_of(inputs[i]) == versions[i], "ltx_kernels.", op,
                  " backward (recompute_norms): an input of ", source,
                  ", whose output it recomputes instead of saving it, was modified in place after "
                  "the forward. Inject with ops excluding 'recompute_norms' (or "
                  "LTX_KERNELS_DISABLE=recompute_norms) to save the output instead.");
    return call();
  }
};

struct RecomputeScope {
  bool on = false;
  // An output's storage -> its call. (The weak reference keeps a freed storage's address from
  // being another storage's while the entry exists.)
  std::unordered_map<const c10::StorageImpl*, std::pair<c10::weak_intrusive_ptr<c10::StorageImpl>,
                                                        c10::intrusive_ptr<Recompute>>>
      outputs;
};
thread_local RecomputeScope recompute_scope_state;

// Within the scope, records `out` (a fresh output of op `source`) as given again by `call`, which
// reads `inputs`.
// (Callers check recompute_scope_state.on first: outside the scope nothing is built.)
void record_recomputable(const Tensor& out, const char* source, std::vector<Tensor> inputs,
                         std::function<Tensor()> call) {
  if (out.numel() == 0) return;
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->source = source;
  recompute->call = std::move(call);
  for (Tensor& t : inputs)
    if (t.defined()) {
      recompute->versions.push_back(version_of(t));
      recompute->inputs.push_back(std::move(t));
    }
  const c10::Storage& storage = out.storage();
  recompute_scope_state.outputs.insert_or_assign(
      storage.unsafeGetStorageImpl(),
      std::make_pair(storage.getWeakStorageImpl(), std::move(recompute)));
}

// What a Function saves of its input t: t, or, when t is a view of an output recorded in the
// scope, an undefined tensor, the call and t's place in the output going to saved_data[key].
Tensor saved_or_recomputed(AutogradContext* ctx, const char* key, const Tensor& t) {
  if (!recompute_scope_state.on || !t.defined() || !t.has_storage()) return t;
  const auto found = recompute_scope_state.outputs.find(t.storage().unsafeGetStorageImpl());
  if (found == recompute_scope_state.outputs.end()) return t;
  ctx->saved_data[key] =
      c10::ivalue::Tuple::create({c10::IValue::make_capsule(found->second.second), t.sizes(),
                                  t.strides(), t.storage_offset()});
  return Tensor();
}

// The input a Function saved with saved_or_recomputed (the recomputed output is laid out as the
// original). A recomputed output is not in the graph: a backward with create_graph=True, whose
// gradients must reach the input's producer, raises instead.
Tensor restored(AutogradContext* ctx, const char* key, const Tensor& saved, const char* op) {
  const auto found = ctx->saved_data.find(key);
  if (saved.defined() || found == ctx->saved_data.end()) return saved;
  TORCH_CHECK(
      !at::GradMode::is_enabled(), "ltx_kernels.", op,
      " backward with create_graph=True (recompute_norms): an input recomputed instead of "
      "saved is not connected to the graph, so its second derivatives would be lost. "
      "Inject with ops excluding 'recompute_norms' (or LTX_KERNELS_DISABLE=recompute_norms) "
      "to differentiate twice.");
  const auto parts = found->second.toTupleRef().elements();
  const auto call = c10::static_intrusive_pointer_cast<Recompute>(parts[0].toCapsule());
  return call->run(op).as_strided(parts[1].toIntVector(), parts[2].toIntVector(), parts[3].toInt());
}

// ------------------------------------------------------------------------------------------------
// Norm ops and gated_residual: one Function over their tensors in norm_modulate_backward's
// gradient order; `kind` says which op computes the forward.
enum NormKind : int64_t {
  kRmsnorm,
  kRmsnormModulate,
  kLayernormModulate,
  kAddRmsnormModulate,
  kAddLayernormModulate,
  kGatedResidual,
};
enum NormInput { kX, kY, kGate, kScale, kShift, kWeight, kBias, kNormInputs };

// The ops with a residual add: their first output is h = x + y [* gate].
bool has_residual(int64_t kind) {
  return kind == kAddRmsnormModulate || kind == kAddLayernormModulate || kind == kGatedResidual;
}

struct NormFunction : public torch::autograd::Function<NormFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& y,
                               const OptTensor& gate, const OptTensor& scale,
                               const OptTensor& shift, const OptTensor& weight,
                               const OptTensor& bias, int64_t kind, double eps, bool upcast) {
    variable_list out = run(x, y, gate, scale, shift, weight, bias, kind, eps, upcast);
    const bool residual = has_residual(kind);
    const auto v = value_or_undefined;
    if (recompute_scope_state.on && kind != kRmsnorm && kind != kGatedResidual) {
      // n, again from x (the add_ ops: from h)
      const int64_t plain = kind == kAddRmsnormModulate     ? kRmsnormModulate
                            : kind == kAddLayernormModulate ? kLayernormModulate
                                                            : kind;
      const Tensor rows = residual ? out[0] : x;
      record_recomputable(
          out.back(), kNames[plain], {rows, v(scale), v(shift), v(weight), v(bias)},
          [=] { return run(rows, {}, {}, scale, shift, weight, bias, plain, eps, upcast).back(); });
    }
    const bool reference =
        (x.is_cuda() && x.sym_size(-1) > LTX_NORM_BACKWARD_MAX_HIDDEN) ||
        (kind == kRmsnorm && weight.has_value() && weight->scalar_type() != x.scalar_type());
    ctx->set_materialize_grads(false);
    ctx->saved_data["defined"] = defined_mask(x, y, gate, scale, shift, weight, bias);
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["upcast"] = upcast;
    ctx->saved_data["reference"] = reference;
    if (reference) {  // the reference VJP recomputes everything from the inputs
      ctx->save_for_backward({x, v(y), v(gate), v(scale), v(shift), v(weight), v(bias)});
      return out;
    }
    // h: the normalized rows (x, or the add_ ops' output); y only for gate's gradient.
    const Tensor h = kind == kGatedResidual ? Tensor() : residual ? out[0] : x;
    const bool keep_y = y.has_value() && requires_grad(gate);
    ctx->save_for_backward(
        {h, keep_y ? *y : Tensor(), v(gate), v(scale), v(shift), v(weight), v(bias)});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t kind = ctx->saved_data["kind"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool upcast = ctx->saved_data["upcast"].toBool();
    const variable_list saved = ctx->get_saved_variables();
    if (ctx->saved_data["reference"].toBool())
      return reference_vjp(ctx, kNames[kind], saved, grads, 3, eps, upcast, false, false);
    const bool norm = kind != kGatedResidual;
    const bool residual = has_residual(kind);
    // Output gradients: of n (the norm ops' last output) and of h (the add_ ops' first output,
    // gated_residual's only one).
    const Tensor grad_n = norm ? grads.back() : Tensor();
    const Tensor grad_h = residual ? grads[0] : Tensor();
    variable_list result(kNormInputs + 3);
    if (!grad_n.defined() && !grad_h.defined()) return result;
    std::array<bool, kNormInputs> wanted{};
    for (int i = 0; i < kNormInputs; ++i) wanted[i] = needs(ctx, i);
    if (!grad_n.defined())  // only h's gradient: the norm's inputs get none
      wanted[kScale] = wanted[kShift] = wanted[kWeight] = wanted[kBias] = false;
    if (at::GradMode::is_enabled())  // create_graph=True
      return differentiable_backward(kind, saved, grad_n, grad_h, wanted, eps, upcast);
    if (!norm || !grad_n.defined()) {  // x's gradient is h's
      if (wanted[kX]) result[kX] = grad_h;
      wanted[kX] = false;
    }
    bool any = false;
    for (bool w : wanted) any = any || w;
    if (!any) return result;
    static const auto backward_op =
        find_op<std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>(
            const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
            const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
            const OptTensor&, double, bool, std::array<bool, 7>)>("norm_modulate_backward");
    const bool with_n = grad_n.defined();
    const auto o = [&](int i, bool keep = true) {
      return keep ? optional(saved[i]) : std::nullopt;
    };
    const auto computed = backward_op.call(
        optional(rows(grad_n)), optional(rows(grad_h)), o(kX, with_n), o(kY), o(kGate),
        o(kScale, with_n), o(kShift), o(kWeight, with_n), o(kBias, with_n), eps,
        kind == kLayernormModulate || kind == kAddLayernormModulate, wanted);
    const std::array<Tensor, kNormInputs> gradients{
        std::get<0>(computed), std::get<1>(computed), std::get<2>(computed), std::get<3>(computed),
        std::get<4>(computed), std::get<5>(computed), std::get<6>(computed)};
    for (int i = 0; i < kNormInputs; ++i)
      if (wanted[i]) result[i] = gradients[i];
    return result;
  }

  // create_graph=True: the gradients as differentiable functions of the output gradients and the
  // saved tensors. The norm's part is the VJP of the plain norm op's reference at the saved h
  // (reference_vjp); for the add_ ops h is this node's output, so the second derivatives reach x,
  // y and gate through it. Then the residual's linear part, in ATen: dh = dh_norm + grad_h,
  // dx = dh, dy = dh * gate, dgate = dh * y summed to gate's shape (in fp32, float64 for float64
  // tensors, rounded once to the input's dtype).
  static variable_list differentiable_backward(int64_t kind, const variable_list& saved,
                                               const Tensor& grad_n, const Tensor& grad_h,
                                               const std::array<bool, kNormInputs>& wanted,
                                               double eps, bool upcast) {
    variable_list result(kNormInputs + 3);
    const bool want_h = wanted[kX] || wanted[kY] || wanted[kGate];
    Tensor dh = grad_h;
    if (kind != kGatedResidual && grad_n.defined()) {
      const int64_t plain = kind == kAddRmsnormModulate     ? kRmsnormModulate
                            : kind == kAddLayernormModulate ? kLayernormModulate
                                                            : kind;
      int64_t mask = want_h ? 1 : 0;  // (bit kX: h, in x's place)
      for (int i = kScale; i < kNormInputs; ++i)
        if (wanted[i]) mask |= int64_t{1} << i;
      if (mask == 0) return result;
      const std::vector<Tensor> computed =
          call_reference_vjp(kNames[plain],
                             {saved[kX], Tensor(), Tensor(), saved[kScale], saved[kShift],
                              saved[kWeight], saved[kBias]},
                             {grad_n}, mask, eps, upcast, false, false);
      for (int i = kScale; i < kNormInputs; ++i)
        if (wanted[i]) result[i] = computed[i];
      if (want_h) dh = dh.defined() ? dh.add(computed[kX]) : computed[kX];
    }
    if (!want_h || !dh.defined()) return result;
    const Tensor &y = saved[kY], &gate = saved[kGate];
    const at::ScalarType c = dh.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    if (wanted[kX]) result[kX] = dh;
    if (wanted[kY])
      result[kY] = gate.defined() ? dh.to(c).mul(gate.to(c)).to(dh.scalar_type()) : dh;
    if (wanted[kGate])
      result[kGate] = at::sum_to(dh.to(c).mul(y.to(c)), gate.sym_sizes()).to(gate.scalar_type());
    return result;
  }

  static constexpr const char* kNames[] = {"rmsnorm",
                                           "rmsnorm_modulate",
                                           "layernorm_modulate",
                                           "add_rmsnorm_modulate",
                                           "add_layernorm_modulate",
                                           "gated_residual"};

  // The op's forward (below autograd).
  static variable_list run(const Tensor& x, const OptTensor& y, const OptTensor& gate,
                           const OptTensor& scale, const OptTensor& shift, const OptTensor& weight,
                           const OptTensor& bias, int64_t kind, double eps, bool upcast) {
    using Pair = std::tuple<Tensor, Tensor>;
    using T = const Tensor&;
    using O = const OptTensor&;
    switch (kind) {
      case kRmsnorm: {
        static const auto op = find_op<Tensor(T, O, double)>("rmsnorm");
        return {call_below_autograd(op, x, weight, eps)};
      }
      case kRmsnormModulate: {
        static const auto op = find_op<Tensor(T, O, O, O, double, bool)>("rmsnorm_modulate");
        return {call_below_autograd(op, x, scale, shift, weight, eps, upcast)};
      }
      case kLayernormModulate: {
        static const auto op = find_op<Tensor(T, O, O, O, O, double, bool)>("layernorm_modulate");
        return {call_below_autograd(op, x, scale, shift, weight, bias, eps, upcast)};
      }
      case kAddRmsnormModulate: {
        static const auto op =
            find_op<Pair(T, T, O, O, O, O, double, bool)>("add_rmsnorm_modulate");
        auto [h, n] = call_below_autograd(op, x, *y, scale, shift, gate, weight, eps, upcast);
        return {h, n};
      }
      case kAddLayernormModulate: {
        static const auto op =
            find_op<Pair(T, T, O, O, O, O, O, double, bool)>("add_layernorm_modulate");
        auto [h, n] = call_below_autograd(op, x, *y, scale, shift, gate, weight, bias, eps, upcast);
        return {h, n};
      }
      default: {
        static const auto op = find_op<Tensor(T, T, O, bool)>("gated_residual");
        return {call_below_autograd(op, x, *y, gate, upcast)};
      }
    }
  }
};

// The Autograd kernel of each norm op: straight to the op's impl unless autograd records.
template <NormKind kKind>
variable_list norm_op(const Tensor& x, const OptTensor& y, const OptTensor& gate,
                      const OptTensor& scale, const OptTensor& shift, const OptTensor& weight,
                      const OptTensor& bias, double eps, bool upcast) {
  if (!recording(x, y, gate, scale, shift, weight, bias))
    return NormFunction::run(x, y, gate, scale, shift, weight, bias, kKind, eps, upcast);
  return NormFunction::apply(x, y, gate, scale, shift, weight, bias, kKind, eps, upcast);
}

// ------------------------------------------------------------------------------------------------
// RoPE and the q/k norm + RoPE.

struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static Tensor run(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
    static const auto op =
        find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, bool)>("rope");
    return call_below_autograd(op, x, cos, sin, interleaved);
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin,
                        bool interleaved) {
    const bool reference = requires_grad(cos) || requires_grad(sin) ||
                           (x.is_cuda() && x.sym_size(-1) > LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW);
    ctx->set_materialize_grads(false);
    ctx->saved_data["defined"] = defined_mask(x, cos, sin);
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["reference"] = reference;
    ctx->save_for_backward({reference ? x : Tensor(), cos, sin});  // dx needs the tables only
    return run(x, cos, sin, interleaved);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    variable_list saved = ctx->get_saved_variables();
    if (ctx->saved_data["reference"].toBool() || at::GradMode::is_enabled()) {
      // (create_graph=True: x is not saved, but rope is linear, its VJP the same at any x: zeros
      // stand in for it)
      if (!saved[0].defined()) {
        if (!grads[0].defined()) return variable_list(4);
        saved[0] = at::zeros_like(grads[0]);
      }
      return reference_vjp(ctx, "rope", saved, grads, 1, 0.0, false, false, interleaved);
    }
    variable_list result(4);
    if (grads[0].defined() && needs(ctx, 0)) {
      static const auto op =
          find_op<Tensor(const Tensor&, const Tensor&, const Tensor&, bool)>("rope_backward");
      result[0] = op.call(rows(grads[0]), saved[1], saved[2], interleaved);
    }
    return result;
  }
};

Tensor rope_op(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved) {
  if (!recording(x, cos, sin)) return RopeFunction::run(x, cos, sin, interleaved);
  return RopeFunction::apply(x, cos, sin, interleaved);
}

struct QkFunction : public torch::autograd::Function<QkFunction> {
  using Pair = std::tuple<Tensor, Tensor>;

  static Pair run(const Tensor& q, const Tensor& k, const OptTensor& q_weight,
                  const OptTensor& k_weight, const OptTensor& cos, const OptTensor& sin, double eps,
                  bool across_heads, bool interleaved) {
    using O = const OptTensor&;
    static const auto op =
        find_op<Pair(const Tensor&, const Tensor&, O, O, O, O, double, bool, bool)>(
            "qk_rmsnorm_rope");
    return call_below_autograd(op, q, k, q_weight, k_weight, cos, sin, eps, across_heads,
                               interleaved);
  }

  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const OptTensor& q_weight, const OptTensor& k_weight,
                               const OptTensor& cos, const OptTensor& sin, double eps,
                               bool across_heads, bool interleaved) {
    const c10::SymInt row =
        q.sym_size(-1) * (across_heads && q.dim() == 4 ? q.sym_size(-2) : c10::SymInt(1));
    const bool reference = requires_grad(cos) || requires_grad(sin) ||
                           (q.is_cuda() && row > LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW);
    ctx->set_materialize_grads(false);
    ctx->saved_data["defined"] = defined_mask(q, k, q_weight, k_weight, cos, sin);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["across_heads"] = across_heads;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["reference"] = reference;
    const auto v = value_or_undefined;
    ctx->save_for_backward({saved_or_recomputed(ctx, "q", q), saved_or_recomputed(ctx, "k", k),
                            v(q_weight), v(k_weight), v(cos), v(sin)});
    auto [q_out, k_out] = run(q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved);
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool across_heads = ctx->saved_data["across_heads"].toBool();
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    variable_list saved = ctx->get_saved_variables();
    saved[0] = restored(ctx, "q", saved[0], "qk_rmsnorm_rope");
    saved[1] = restored(ctx, "k", saved[1], "qk_rmsnorm_rope");
    if (ctx->saved_data["reference"].toBool() || at::GradMode::is_enabled())  // (create_graph)
      return reference_vjp(ctx, "qk_rmsnorm_rope", saved, grads, 3, eps, false, across_heads,
                           interleaved);
    variable_list result(9);
    std::array<bool, 4> wanted{};
    for (int i = 0; i < 4; ++i) wanted[i] = needs(ctx, i);
    if (!(wanted[0] || wanted[1] || wanted[2] || wanted[3])) return result;
    if (!grads[0].defined() && !grads[1].defined()) return result;
    const auto grad_or_zeros = [](const Tensor& g, const Tensor& like) {
      return g.defined() ? g.contiguous() : at::zeros_like(like);
    };
    using O = const OptTensor&;
    static const auto op = find_op<std::tuple<Tensor, Tensor, Tensor, Tensor>(
        const Tensor&, const Tensor&, const Tensor&, const Tensor&, O, O, O, O, double, bool, bool,
        std::array<bool, 2>)>("qk_rmsnorm_rope_backward");
    const auto [dq, dk, dq_weight, dk_weight] =
        op.call(grad_or_zeros(grads[0], saved[0]), grad_or_zeros(grads[1], saved[1]), saved[0],
                saved[1], optional(saved[2]), optional(saved[3]), optional(saved[4]),
                optional(saved[5]), eps, across_heads, interleaved, {wanted[2], wanted[3]});
    const std::array<Tensor, 4> gradients{dq, dk, dq_weight, dk_weight};
    for (int i = 0; i < 4; ++i)
      if (wanted[i]) result[i] = gradients[i];
    return result;
  }
};

std::tuple<Tensor, Tensor> qk_rmsnorm_rope_op(const Tensor& q, const Tensor& k,
                                              const OptTensor& q_weight, const OptTensor& k_weight,
                                              const OptTensor& cos, const OptTensor& sin,
                                              double eps, bool across_heads, bool interleaved) {
  if (!recording(q, k, q_weight, k_weight, cos, sin))
    return QkFunction::run(q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved);
  const variable_list out =
      QkFunction::apply(q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved);
  return {out[0], out[1]};
}

// ------------------------------------------------------------------------------------------------
// GELU and GEGLU (x saved; the fused backward op recomputes the activation's derivative; under
// create_graph=True ATen's, differentiable: gelu_backward with the fused op's rounding points,
// GEGLU's dh = dout * gelu(g), dg = gelu'(g) * (dout * h)).
struct ActivationFunction : public torch::autograd::Function<ActivationFunction> {
  using Signature = Tensor(const Tensor&, c10::string_view);

  static const c10::TypedOperatorHandle<Signature>& forward_op(bool geglu) {
    static const auto gelu = find_op<Signature>("gelu");
    static const auto geglu_op = find_op<Signature>("geglu");
    return geglu ? geglu_op : gelu;
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, c10::string_view approximate,
                        bool geglu) {
    ctx->saved_data["approximate"] = std::string(approximate);
    ctx->saved_data["geglu"] = geglu;
    ctx->save_for_backward({x});
    return call_below_autograd(forward_op(geglu), x, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    using Backward = Tensor(const Tensor&, const Tensor&, c10::string_view);
    static const auto gelu_backward = find_op<Backward>("gelu_backward");
    static const auto geglu_backward = find_op<Backward>("geglu_backward");
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const bool geglu = ctx->saved_data["geglu"].toBool();
    const Tensor x = ctx->get_saved_variables()[0];
    if (at::GradMode::is_enabled()) {  // create_graph=True
      if (!geglu) return {at::gelu_backward(grads[0], x, approximate), Tensor(), Tensor()};
      const std::vector<Tensor> halves = x.chunk(2, -1);  // hidden, gate
      return {at::cat({grads[0].mul(at::gelu(halves[1], approximate)),
                       at::gelu_backward(grads[0].mul(halves[0]), halves[1], approximate)},
                      -1),
              Tensor(), Tensor()};
    }
    const auto& op = geglu ? geglu_backward : gelu_backward;
    return {op.call(grads[0].contiguous(), x, approximate), Tensor(), Tensor()};
  }
};

template <bool kGeglu>
Tensor activation_op(const Tensor& x, c10::string_view approximate) {
  if (!recording(x))
    return call_below_autograd(ActivationFunction::forward_op(kGeglu), x, approximate);
  return ActivationFunction::apply(x, approximate, kGeglu);
}

// gelu_tanh(x @ weight^T + bias): dpre = gelu'(pre) * grad with pre recomputed by the forward's
// GEMM; dx = dpre @ weight; dweight = dpre^T x; dbias = dpre summed over rows.
struct LinearGeluFunction : public torch::autograd::Function<LinearGeluFunction> {
  using Signature = Tensor(const Tensor&, const Tensor&, const OptTensor&);

  static const c10::TypedOperatorHandle<Signature>& op() {
    static const auto handle = find_op<Signature>("linear_gelu");
    return handle;
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const OptTensor& bias) {
    ctx->saved_data["defined"] = defined_mask(x, weight, bias);
    ctx->save_for_backward({x, weight, value_or_undefined(bias)});
    return call_below_autograd(op(), x, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
    const Tensor pre = at::linear(x, weight, optional(bias));
    const Tensor dpre = at::gelu_backward(grads[0], pre, "tanh");
    const Tensor dpre_rows = as_rows(dpre);
    variable_list result(3);
    if (needs(ctx, 0)) result[0] = at::matmul(dpre, weight);
    if (needs(ctx, 1)) result[1] = dpre_rows.t().mm(as_rows(x));
    if (needs(ctx, 2)) result[2] = dpre_rows.sum(0);
    return result;
  }
};

Tensor linear_gelu_op(const Tensor& x, const Tensor& weight, const OptTensor& bias) {
  if (!recording(x, weight, bias))
    return call_below_autograd(LinearGeluFunction::op(), x, weight, bias);
  return LinearGeluFunction::apply(x, weight, bias);
}

// x W^T + b plus LoRA updates (linear_ops.cpp): the forward is the op (one node under
// torch.compile, whose in-place column updates functionalization would otherwise turn into copies
// of the whole output); the backward is lora_linear_backward's GEMMs from the saved x, weight and
// adapters. Autograd numbers the defined tensors: x, weight, bias (when given), each lora_a, each
// lora_b.
struct LoraLinearFunction : public torch::autograd::Function<LoraLinearFunction> {
  using Signature = Tensor(const Tensor&, const Tensor&, const OptTensor&, at::TensorList,
                           at::TensorList, c10::ArrayRef<double>, c10::IntArrayRef);

  static const c10::TypedOperatorHandle<Signature>& op() {
    static const auto handle = find_op<Signature>("lora_linear");
    return handle;
  }

  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                        const OptTensor& bias, at::TensorList lora_a, at::TensorList lora_b,
                        c10::ArrayRef<double> scaling, c10::IntArrayRef offsets) {
    ctx->saved_data["has_bias"] = value_or_undefined(bias).defined();
    ctx->saved_data["scaling"] = std::vector<double>(scaling.begin(), scaling.end());
    ctx->saved_data["offsets"] = offsets.vec();
    variable_list saved{saved_or_recomputed(ctx, "x", x), weight};
    saved.insert(saved.end(), lora_a.begin(), lora_a.end());
    saved.insert(saved.end(), lora_b.begin(), lora_b.end());
    ctx->save_for_backward(saved);
    Tensor out = call_below_autograd(op(), x, weight, bias, lora_a, lora_b, scaling, offsets);
    if (recompute_scope_state.on && lora_a.size() == 1 &&
        lora_b[0].size(0) == weight.size(0)) {  // one projection
      const std::vector<Tensor> a = lora_a.vec(), b = lora_b.vec();
      const std::vector<double> s = scaling.vec();
      const std::vector<int64_t> o = offsets.vec();
      record_recomputable(out, "lora_linear", {x, weight, value_or_undefined(bias), a[0], b[0]},
                          [=] { return call_below_autograd(op(), x, weight, bias, a, b, s, o); });
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    saved[0] = restored(ctx, "x", saved[0], "lora_linear");
    const size_t adapters = (saved.size() - 2) / 2;
    const std::vector<Tensor> lora_a(saved.begin() + 2, saved.begin() + 2 + adapters);
    const std::vector<Tensor> lora_b(saved.begin() + 2 + adapters, saved.end());
    const std::vector<double> scaling = ctx->saved_data["scaling"].toDoubleVector();
    const std::vector<int64_t> offsets = ctx->saved_data["offsets"].toIntVector();
    std::vector<bool> wanted(3 + 2 * adapters, false);
    size_t edge = 0;
    wanted[0] = ctx->needs_input_grad(edge++);
    wanted[1] = ctx->needs_input_grad(edge++);
    if (ctx->saved_data["has_bias"].toBool()) wanted[2] = ctx->needs_input_grad(edge++);
    for (size_t i = 3; i < wanted.size(); ++i) wanted[i] = ctx->needs_input_grad(edge++);
    variable_list result = lora_linear_backward(grads[0], saved[0], saved[1], lora_a, lora_b,
                                                scaling, offsets, wanted);
    result.resize(result.size() + 2);  // (scaling, offsets)
    return result;
  }
};

Tensor lora_linear_op(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                      at::TensorList lora_a, at::TensorList lora_b, c10::ArrayRef<double> scaling,
                      c10::IntArrayRef offsets) {
  bool record = recording(x, weight, bias);
  for (const Tensor& t : lora_a) record = record || recording(t);
  for (const Tensor& t : lora_b) record = record || recording(t);
  if (!record)
    return call_below_autograd(LoraLinearFunction::op(), x, weight, bias, lora_a, lora_b, scaling,
                               offsets);
  return LoraLinearFunction::apply(x, weight, bias, lora_a, lora_b, scaling, offsets);
}

// ------------------------------------------------------------------------------------------------
// Ops without a derivative (the backward ops, the quantized ops, attention for now): their outputs
// get a node that raises when differentiated, naming the op, never a gradient silently cut off.
std::string op_name(const c10::OperatorHandle& op) {
  const std::string& name = op.schema().name();
  return "ltx_kernels." + name.substr(name.find("::") + 2);
}

std::string not_differentiable_message(const c10::OperatorHandle& op) {
  return op_name(op) +
         " is not differentiable: the fused backward ops compute first derivatives only (for "
         "second derivatives differentiate the forward op with create_graph=True)";
}

std::string quant_message(const c10::OperatorHandle& op) {
  return op_name(op) +
         " has no backward: the FP8 path (inject_optimized_kernels(..., fp8=True)) is for "
         "inference; train with the bf16 ops (fp8=False)";
}

std::string attention_message(const c10::OperatorHandle& op) {
  return op_name(op) +
         " has no backward yet (its derivative is a later issue): under autograd attend with "
         "torch.nn.functional.scaled_dot_product_attention";
}

// A new autograd node: held by std::shared_ptr up to torch 2.14, by c10::intrusive_ptr from 2.15.
template <class Node, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, Node>)
    return c10::make_intrusive<Node>(std::forward<Args>(args)...);
  else
    return std::make_shared<Node>(std::forward<Args>(args)...);
}

template <std::string (*kMessage)(const c10::OperatorHandle&)>
void raise_when_differentiated(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                               torch::jit::Stack* stack) {
  const size_t num_arguments = op.schema().arguments().size();
  std::vector<Tensor> inputs;
  for (size_t i = stack->size() - num_arguments; i < stack->size(); ++i)
    if ((*stack)[i].isTensor()) inputs.push_back((*stack)[i].toTensor());
  bool record = false;
  for (const Tensor& t : inputs) record = record || requires_grad(t);
  record = record && at::GradMode::is_enabled();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  if (!record) return;
  const auto node =
      make_node<torch::autograd::Error>(kMessage(op), torch::autograd::collect_next_edges(inputs));
  const size_t num_returns = op.schema().returns().size();
  for (size_t i = stack->size() - num_returns; i < stack->size(); ++i) {
    if (!(*stack)[i].isTensor()) continue;
    Tensor out = (*stack)[i].toTensor();
    if (out.defined() && torch::autograd::isDifferentiableType(out.scalar_type()))
      torch::autograd::set_history(out, node);
  }
}

}  // namespace

void recompute_scope(bool on) {
  recompute_scope_state.on = on;
  recompute_scope_state.outputs.clear();
}

TORCH_LIBRARY_IMPL_EXPAND(LTX_OPS_NAMESPACE, Autograd, m) {
  using O = const OptTensor&;
  m.impl("rmsnorm", [](const Tensor& x, O weight, double eps) {
    return norm_op<kRmsnorm>(x, {}, {}, {}, {}, weight, {}, eps, false)[0];
  });
  m.impl("rmsnorm_modulate",
         [](const Tensor& x, O scale, O shift, O weight, double eps, bool upcast) {
           return norm_op<kRmsnormModulate>(x, {}, {}, scale, shift, weight, {}, eps, upcast)[0];
         });
  m.impl("layernorm_modulate", [](const Tensor& x, O scale, O shift, O weight, O bias, double eps,
                                  bool upcast) {
    return norm_op<kLayernormModulate>(x, {}, {}, scale, shift, weight, bias, eps, upcast)[0];
  });
  m.impl("add_rmsnorm_modulate", [](const Tensor& x, const Tensor& y, O scale, O shift, O gate,
                                    O weight, double eps, bool upcast) {
    const auto out =
        norm_op<kAddRmsnormModulate>(x, y, gate, scale, shift, weight, {}, eps, upcast);
    return std::make_tuple(out[0], out[1]);
  });
  m.impl("add_layernorm_modulate", [](const Tensor& x, const Tensor& y, O scale, O shift, O gate,
                                      O weight, O bias, double eps, bool upcast) {
    const auto out =
        norm_op<kAddLayernormModulate>(x, y, gate, scale, shift, weight, bias, eps, upcast);
    return std::make_tuple(out[0], out[1]);
  });
  m.impl("gated_residual", [](const Tensor& x, const Tensor& y, O gate, bool upcast) {
    return norm_op<kGatedResidual>(x, y, gate, {}, {}, {}, {}, 0.0, upcast)[0];
  });
  m.impl("rope", &rope_op);
  m.impl("qk_rmsnorm_rope", &qk_rmsnorm_rope_op);
  m.impl("gelu", &activation_op<false>);
  m.impl("geglu", &activation_op<true>);
  m.impl("linear_gelu", &linear_gelu_op);
  m.impl("lora_linear", &lora_linear_op);
  for (const char* name :
       {"rmsnorm_modulate_quant", "layernorm_modulate_quant", "add_rmsnorm_modulate_quant",
        "add_layernorm_modulate_quant", "quantize", "qk_rmsnorm_rope_quant"})
    m.impl(name,
           torch::CppFunction::makeFromBoxedFunction<&raise_when_differentiated<&quant_message>>());
  for (const char* name :
       {"attention", "attention_int8", "quantize_attention_k", "quantize_attention_v"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &raise_when_differentiated<&attention_message>>());
  for (const char* name : {"gelu_backward", "geglu_backward", "norm_modulate_backward",
                           "rope_backward", "qk_rmsnorm_rope_backward"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &raise_when_differentiated<&not_differentiable_message>>());
}
