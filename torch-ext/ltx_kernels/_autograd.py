"""Autograd of every op, registered with `torch.library.register_autograd`, so that no op is ever
differentiated silently wrong (an op without a registration would let autograd through with a
warning and drop the gradients of its inputs).

Backward of each op, for now, is the vector-Jacobian product of its reference
(`ltx_kernels.reference.<op>`, computed in fp32 with the forward's rounding points, so gradients are
rounded where the diffusers code's own backward rounds them): exact for every input the op takes
(x, y, weight, bias, scale, shift, gate, cos, sin), every broadcast form reduced back to the
input's shape, and only the gradients autograd asks for. It is plain PyTorch, so it traces under
torch.compile / AOTAutograd and CUDA graphs. linear_gelu's backward recomputes the pre-activation
with the forward's GEMM and runs the three gradient GEMMs through cuBLAS, as PyTorch's own
`gelu(linear(x))` does. Double backward (create_graph=True) is differentiated too.

Fused backward kernels (CUDA C + C CPU twins behind the functional backward ops of
_op_names.BACKWARD_OPS) replace these one op at a time and keep this registration's contract: so
far gelu and geglu (gelu_backward, geglu_backward), the norm ops and gated_residual
(norm_modulate_backward), rope (rope_backward) and qk_rmsnorm_rope (qk_rmsnorm_rope_backward). Double backward of those goes through the reference VJP above (their
backward ops are not differentiated; their own registration raises).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference
from ._op_names import BACKWARD_OPS, FP8_OPS, FUSED_BACKWARD_OPS
from ._op_namespace import add_op_namespace_prefix, ops


def _is_tensor_argument(argument) -> bool:
    return "Tensor" in str(argument.type)


def _reference_backward(name: str):
    """setup_context and backward of op `name`: the VJP of reference.<name> (fp32 math)."""
    schema = getattr(ops, name).default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    tensor_positions = [i for i, a in enumerate(positional) if _is_tensor_argument(a)]
    reference_fn = getattr(reference, name)

    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        # inputs: the positional arguments with their defaults filled in; keyword-only arguments
        # (upcast) are never tensors.
        ctx.save_for_backward(*(inputs[i] for i in tensor_positions))
        ctx.values = [None if i in tensor_positions else v for i, v in enumerate(inputs)]
        ctx.keywords = keyword_only_inputs or {}

    def backward(ctx, *grads):
        # needs_input_grad covers the arguments the caller passed (defaulted ones are left out).
        needs = [
            i < len(ctx.needs_input_grad) and ctx.needs_input_grad[i]
            for i in range(len(positional))
        ]
        # create_graph=True (double backward) runs this in grad mode: differentiate through the
        # saved tensors themselves, so the returned gradients stay connected to the inputs.
        create_graph = torch.is_grad_enabled()
        values = list(ctx.values)
        for i, saved in zip(tensor_positions, ctx.saved_tensors):
            if saved is not None and not create_graph:
                saved = saved.detach().requires_grad_(needs[i])
            values[i] = saved
        wanted = [i for i in tensor_positions if needs[i]]
        # fp32 math, as the forward's; float64 inputs (gradcheck on the CPU) in float64.
        float64 = any(t is not None and t.dtype == torch.float64 for t in ctx.saved_tensors)
        compute_dtype = torch.float64 if float64 else torch.float32
        with torch.enable_grad():
            outputs = reference_fn(*values, **ctx.keywords, compute_dtype=compute_dtype)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        result = [None] * len(positional)
        if pairs and wanted:
            computed = torch.autograd.grad(
                [o for o, _ in pairs],
                [values[i] for i in wanted],
                [g for _, g in pairs],
                allow_unused=True,
                create_graph=create_graph,
            )
            for i, g in zip(wanted, computed):
                result[i] = g if g is not None else torch.zeros_like(values[i])
        return tuple(result)

    return setup_context, backward


def _linear_gelu_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # x, weight, bias (None without one)


def _linear_gelu_backward(ctx, grad):
    """gelu_tanh(x @ W^T + b): the pre-activation recomputed in the forward's dtype, then
    dpre = gelu'(pre) * grad; dx = dpre @ W; dW = dpre^T x; db = dpre summed over rows."""
    x, weight, bias = ctx.saved_tensors
    need_x, need_weight, need_bias = (*ctx.needs_input_grad, False, False)[:3]
    dpre = torch.ops.aten.gelu_backward(grad, F.linear(x, weight, bias), approximate="tanh")
    rows = dpre.reshape(-1, dpre.shape[-1])
    dx = dpre @ weight if need_x else None
    dweight = rows.t() @ x.reshape(-1, x.shape[-1]) if need_weight else None
    dbias = rows.sum(0) if need_bias else None
    return dx, dweight, dbias


def _fused_gelu_backward(name: str):
    """setup_context and backward of gelu or geglu (x, approximate): the fused backward op
    <name>_backward; under create_graph=True, the reference VJP (differentiable again)."""
    setup_context, reference_backward = _reference_backward(name)
    fused = getattr(ops, FUSED_BACKWARD_OPS[name])

    def backward(ctx, grad):
        if torch.is_grad_enabled():  # double backward
            return reference_backward(ctx, grad)
        if not ctx.needs_input_grad[0]:
            return None, None
        (x,) = ctx.saved_tensors
        return fused(grad.contiguous(), x, ctx.values[1]), None

    return setup_context, backward


# The gradients norm_modulate_backward returns, in its order.
_NORM_GRADIENTS = ("x", "y", "gate", "scale", "shift", "weight", "bias")
_MAX_CUDA_HIDDEN = 8192  # LTX_NORM_BACKWARD_MAX_HIDDEN (ltx_kernels.h); longer rows: the reference


def _fused_norm_backward(name: str):
    """setup_context and backward of a norm op or gated_residual: norm_modulate_backward.

    Saved: the rows the op normalized (x, or for the add_ ops their output h), the modulation
    tensors, weight and bias, and y only when gate's gradient is wanted; the row statistics are
    recomputed from h by the kernel. Double backward (create_graph=True) differentiates the
    reference of the norm part at the saved h instead (differentiable again). rmsnorm with a weight
    of another dtype than x, and CUDA rows above 8192 elements, take the reference VJP."""
    schema = getattr(ops, name).default._schema
    names = [a.name for a in schema.arguments if not a.kwarg_only]
    reference_setup, reference_backward = _reference_backward(name)
    norm = name != "gated_residual"
    residual = "y" in names
    layer_norm = "layernorm" in name

    def uses_reference(args) -> bool:
        x, weight = args["x"], args.get("weight")
        if x.is_cuda and x.shape[-1] > _MAX_CUDA_HIDDEN:
            return True
        return name == "rmsnorm" and weight is not None and weight.dtype != x.dtype

    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        args = dict(zip(names, inputs))
        ctx.reference = uses_reference(args)
        if ctx.reference:
            reference_setup(ctx, inputs, output, keyword_only_inputs)
            return
        gate, y = args.get("gate"), args.get("y")
        h = (output[0] if residual else args["x"]) if norm else None
        keep_y = y is not None and gate is not None and gate.requires_grad
        ctx.save_for_backward(
            h,
            y if keep_y else None,
            gate,
            args.get("scale"),
            args.get("shift"),
            args.get("weight"),
            args.get("bias"),
        )
        ctx.eps = args.get("eps", 1e-6)
        ctx.upcast = (keyword_only_inputs or {}).get("upcast", False)

    def backward(ctx, *grads):
        if ctx.reference:
            return reference_backward(ctx, *grads)
        needs = {
            n: i < len(ctx.needs_input_grad) and ctx.needs_input_grad[i]
            for i, n in enumerate(names)
        }
        h, y, gate, scale, shift, weight, bias = ctx.saved_tensors
        # Output gradients: of n (the norm ops' last output) and of h (add_ ops: the first;
        # gated_residual: its output).
        grad_n = grads[-1] if norm else None
        grad_h = grads[0] if residual else None
        if torch.is_grad_enabled():  # double backward
            return _norm_double_backward(
                name, ctx, needs, names, grad_n, grad_h, h, y, gate, scale, shift, weight, bias
            )
        result = dict.fromkeys(names)
        if grad_n is None and grad_h is None:
            return tuple(result[n] for n in names)
        if grad_n is None:  # only h's gradient: the norm's inputs get none
            norm_inputs = ("scale", "shift", "weight", "bias")
            needs = {n: needs[n] and n not in norm_inputs for n in names}
        wanted = [needs.get(n, False) for n in _NORM_GRADIENTS]
        if not norm or grad_n is None:  # x's gradient is h's
            result["x"] = grad_h if needs["x"] else None
            wanted[0] = False
        if any(wanted):
            computed = ops.norm_modulate_backward(
                _rows(grad_n),
                _rows(grad_h),
                h if grad_n is not None else None,
                y,
                gate,
                scale if grad_n is not None else None,
                shift,
                weight if grad_n is not None else None,
                bias if grad_n is not None else None,
                ctx.eps,
                layer_norm,
                wanted,
            )
            for n, want, g in zip(_NORM_GRADIENTS, wanted, computed):
                if want:
                    result[n] = g
        return tuple(result[n] for n in names)

    return setup_context, backward


_MAX_CUDA_ROPE_ROW = 8192  # LTX_QK_NORM_ROPE_BACKWARD_MAX_ROW (ltx_kernels.h)


def _fused_rope_backward(name: str):
    """setup_context and backward of rope or qk_rmsnorm_rope: rope_backward (the transposed
    rotation) or qk_rmsnorm_rope_backward (with the norm's VJP and the weights' gradients).

    Saved: the op's inputs (as the reference VJP saves them; x is read again only by the norm).
    cos/sin that require grad, CUDA rows above 8192 elements and double backward (create_graph=True)
    take the reference VJP."""
    reference_setup, reference_backward = _reference_backward(name)
    schema = getattr(ops, name).default._schema
    names = [a.name for a in schema.arguments if not a.kwarg_only]
    fused = getattr(ops, FUSED_BACKWARD_OPS[name])

    def uses_reference(args) -> bool:
        if any(t is not None and t.requires_grad for t in (args["cos"], args["sin"])):
            return True
        x = args["x"] if name == "rope" else args["q"]
        across = name != "rope" and args["across_heads"] and x.dim() == 4
        row = x.shape[-1] * (x.shape[-2] if across else 1)
        return x.is_cuda and row > _MAX_CUDA_ROPE_ROW

    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        reference_setup(ctx, inputs, output, keyword_only_inputs)
        ctx.reference = uses_reference(dict(zip(names, inputs)))

    def backward(ctx, *grads):
        if ctx.reference or torch.is_grad_enabled():  # (double backward: differentiable again)
            return reference_backward(ctx, *grads)
        needs = [
            i < len(ctx.needs_input_grad) and ctx.needs_input_grad[i] for i in range(len(names))
        ]
        args = dict(zip(names, ctx.values))
        if name == "rope":
            _, cos, sin = ctx.saved_tensors
            dx = fused(_rows(grads[0]), cos, sin, args["interleaved"]) if needs[0] else None
            return dx, None, None, None
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        if not any(needs[:4]):
            return (None,) * len(names)
        grad_q, grad_k = (
            torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, (q, k))
        )
        dq, dk, dq_weight, dk_weight = fused(
            grad_q,
            grad_k,
            q,
            k,
            q_weight,
            k_weight,
            cos,
            sin,
            args["eps"],
            args["across_heads"],
            args["interleaved"],
            [needs[2], needs[3]],
        )
        computed = (dq, dk, dq_weight, dk_weight)
        return tuple(computed[i] if i < 4 and needs[i] else None for i in range(len(names)))

    return setup_context, backward


def _rows(grad):
    """An output gradient as the kernels take it: a contiguous last dim (autograd may hand over
    expanded zeros or scalars)."""
    if grad is None or grad.stride(-1) == 1:
        return grad
    return grad.contiguous()


def _norm_double_backward(
    name, ctx, needs, names, grad_n, grad_h, h, y, gate, scale, shift, weight, bias
):
    """create_graph=True: the norm's VJP by autograd of its reference at the saved h (which stays
    connected to x, y and gate), then the residual's (dx = dh, dy = dh * gate, dgate = dh * y)."""
    c = torch.float64 if h is not None and h.dtype == torch.float64 else torch.float32
    result = dict.fromkeys(names)
    dh = grad_h
    if grad_n is not None and h is not None:
        norm_inputs = {"scale": scale, "shift": shift, "weight": weight, "bias": bias}
        targets = [("h", h)] if h.requires_grad else []
        targets += [(n, t) for n, t in norm_inputs.items() if t is not None and needs.get(n)]
        if name == "rmsnorm":
            n_out = reference.rmsnorm(h, weight, ctx.eps, compute_dtype=c, round_output=False)
        else:
            kind = "layer" if "layernorm" in name else "rms"
            n_out = reference._norm_modulate(
                h, scale, shift, weight, bias, ctx.eps, kind, ctx.upcast, c, h.dtype
            )
        if targets:
            computed = torch.autograd.grad(
                n_out,
                [t for _, t in targets],
                grad_n.to(n_out.dtype),
                create_graph=True,
                allow_unused=True,
            )
            for (n, t), g in zip(targets, computed):
                g = torch.zeros_like(t) if g is None else g.to(t.dtype)
                if n == "h":
                    dh = g if dh is None else dh + g
                else:
                    result[n] = g
    if dh is not None:
        result["x"] = dh if needs.get("x") else None
        if needs.get("y"):
            result["y"] = dh if gate is None else (dh * gate).to(dh.dtype)
        if needs.get("gate") and gate is not None:
            result["gate"] = (dh * y).sum_to_size(gate.shape).to(gate.dtype)
    return tuple(result[n] for n in names)


def _not_differentiable(name: str):
    """setup_context and backward of a backward op: differentiating it raises, naming it."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"ltx_kernels.{name} is not differentiable; for higher-order gradients differentiate "
            "the forward op with create_graph=True (its double backward does not call this op)"
        )

    return (lambda ctx, inputs, output: None), backward


def _fp8_inference_only(name: str):
    """setup_context and backward of an FP8-output op: differentiating it raises, naming it."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"ltx_kernels.{name} has no backward: the FP8 path (inject_optimized_kernels(..., "
            "fp8=True)) is for inference; train with the bf16 ops (fp8=False)"
        )

    return (lambda ctx, inputs, output, keyword_only_inputs=None: None), backward


def register(names) -> None:
    """Registers the autograd of every op in `names` (all of them: OPS + FP8_OPS +
    BACKWARD_OPS)."""
    for name in names:
        if name == "linear_gelu":
            setup_context, backward = _linear_gelu_setup_context, _linear_gelu_backward
        elif FUSED_BACKWARD_OPS.get(name) in ("gelu_backward", "geglu_backward"):
            setup_context, backward = _fused_gelu_backward(name)
        elif FUSED_BACKWARD_OPS.get(name) == "norm_modulate_backward":
            setup_context, backward = _fused_norm_backward(name)
        elif FUSED_BACKWARD_OPS.get(name) in ("rope_backward", "qk_rmsnorm_rope_backward"):
            setup_context, backward = _fused_rope_backward(name)
        elif name in BACKWARD_OPS:
            setup_context, backward = _not_differentiable(name)
        elif name in FP8_OPS:
            setup_context, backward = _fp8_inference_only(name)
        else:
            setup_context, backward = _reference_backward(name)
        torch.library.register_autograd(
            add_op_namespace_prefix(name), backward, setup_context=setup_context
        )
