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
far gelu and geglu (gelu_backward, geglu_backward). Double backward of those goes through the
reference VJP above (their backward ops are not differentiated; their own registration raises).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference
from ._op_names import BACKWARD_OPS
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
    fused = getattr(ops, f"{name}_backward")

    def backward(ctx, grad):
        if torch.is_grad_enabled():  # double backward
            return reference_backward(ctx, grad)
        if not ctx.needs_input_grad[0]:
            return None, None
        (x,) = ctx.saved_tensors
        return fused(grad.contiguous(), x, ctx.values[1]), None

    return setup_context, backward


def _not_differentiable(name: str):
    """setup_context and backward of a backward op: differentiating it raises, naming it."""

    def backward(ctx, *grads):
        raise RuntimeError(
            f"ltx_kernels.{name} is not differentiable; for higher-order gradients differentiate "
            "the forward op with create_graph=True (its double backward does not call this op)"
        )

    return (lambda ctx, inputs, output: None), backward


def register(names) -> None:
    """Registers the autograd of every op in `names` (all of them: OPS + BACKWARD_OPS)."""
    for name in names:
        if name == "linear_gelu":
            setup_context, backward = _linear_gelu_setup_context, _linear_gelu_backward
        elif name in ("gelu", "geglu"):
            setup_context, backward = _fused_gelu_backward(name)
        elif name in BACKWARD_OPS:
            setup_context, backward = _not_differentiable(name)
        else:
            setup_context, backward = _reference_backward(name)
        torch.library.register_autograd(
            add_op_namespace_prefix(name), backward, setup_context=setup_context
        )
