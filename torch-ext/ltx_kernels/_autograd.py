"""The reference VJP of the ops, for the inputs their fused backward kernels do not take and for
second derivatives.

Autograd of every op is registered in C++ (torch-ext/autograd_ops.cpp, the Autograd dispatch key):
a call under autograd records one node whose backward calls the op's fused backward op
(_op_names.FUSED_BACKWARD_OPS; linear_gelu's runs ATen's gelu_backward and cuBLAS GEMMs), so no
op is ever differentiated silently wrong and a call costs no Python. The FP8 ops and the backward
ops record a node that raises when differentiated, naming the op.

What the fused kernels do not take goes to `reference_vjp`, which that C++ calls through the op
`reference_vjp` defined here (CompositeImplicitAutograd, so it traces under torch.compile): CUDA
rows above the kernels' limit (8192 elements), an rmsnorm weight of another dtype than x (mixed
precision), RoPE tables that require grad. It is the vector-Jacobian product of
`ltx_kernels.reference.<op>` (fp32 math with the forward's rounding points; float64 inputs in
float64), every broadcast form reduced back to the input's shape, only the gradients asked for.
Under create_graph=True it is differentiable again, so a backward with create_graph=True (second
derivatives) takes it instead of the fused backward ops (whose outputs are not differentiable):
the norm ops' at their saved h (the plain norm op's VJP, the residual's part in C++), rope's and
qk_rmsnorm_rope's (gelu and geglu take ATen's GELU derivative there).
"""

from __future__ import annotations

import torch

from . import reference
from ._op_names import REFERENCE_VJP_OP
from ._op_namespace import add_op_namespace_prefix, ops

# The tensors of each op in the order autograd_ops.cpp passes them (its Functions' arguments).
_NORM_TENSORS = ("x", "y", "gate", "scale", "shift", "weight", "bias")
TENSOR_ORDER = {
    "rmsnorm": _NORM_TENSORS,
    "rmsnorm_modulate": _NORM_TENSORS,
    "layernorm_modulate": _NORM_TENSORS,
    "add_rmsnorm_modulate": _NORM_TENSORS,
    "add_layernorm_modulate": _NORM_TENSORS,
    "gated_residual": _NORM_TENSORS,
    "rope": ("x", "cos", "sin"),
    "qk_rmsnorm_rope": ("q", "k", "q_weight", "k_weight", "cos", "sin"),
}

REFERENCE_VJP_SCHEMA = (
    f"{REFERENCE_VJP_OP}(str op, Tensor?[] inputs, Tensor?[] grad_outputs, int wanted, float eps, "
    "bool upcast, bool across_heads, bool interleaved) -> Tensor[]"
)


def reference_vjp(op, inputs, grad_outputs, wanted, eps, upcast, across_heads, interleaved):
    """Gradients of op's inputs (TENSOR_ORDER[op]; bit i of `wanted` asks for the i-th) for the
    gradients of its outputs, by autograd of reference.<op> at `inputs`. One tensor per input: the
    gradient where asked for, an empty placeholder elsewhere."""
    schema = getattr(ops, op).default._schema
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    keywords = {"upcast": upcast} if any(a.name == "upcast" for a in schema.arguments) else {}
    names = TENSOR_ORDER[op]
    want = [bool((wanted >> i) & 1) and t is not None for i, t in enumerate(inputs)]
    # create_graph=True (double backward) runs this in grad mode: differentiate at aliases of the
    # inputs (views), so the returned gradients stay connected to the graph, and are the partial
    # derivatives at each input, not through its history (the add_ ops' h is the output of the node
    # calling this, which depends on scale; an x computed from weight). A wanted input that does
    # not require grad is a stand-in on which the VJP does not depend (rope's x).
    create_graph = torch.is_grad_enabled()
    tensors = {}
    for name, t, w in zip(names, inputs, want):
        if t is not None and (not create_graph or (w and not t.requires_grad)):
            t = t.detach().requires_grad_(w)
        elif t is not None and w:
            t = t.view_as(t)
        tensors[name] = t
    scalars = {"eps": eps, "across_heads": across_heads, "interleaved": interleaved}
    values = [tensors[n] if n in tensors else scalars[n] for n in positional]
    # fp32 math, as the forward's; float64 inputs (gradcheck on the CPU) in float64.
    float64 = any(t is not None and t.dtype == torch.float64 for t in inputs)
    compute_dtype = torch.float64 if float64 else torch.float32
    with torch.enable_grad():
        outputs = getattr(reference, op)(*values, **keywords, compute_dtype=compute_dtype)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
    targets = [tensors[n] for n, w in zip(names, want) if w]
    computed = iter(
        torch.autograd.grad(
            [o for o, _ in pairs],
            targets,
            [g for _, g in pairs],
            allow_unused=True,
            create_graph=create_graph,
        )
        if pairs and targets
        else [None] * len(targets)
    )
    result = []
    for name, w in zip(names, want):
        t = tensors[name]
        if not w:
            result.append(torch.empty(0, device=inputs[0].device))
            continue
        g = next(computed)
        result.append(g if g is not None else torch.zeros_like(t))
    return result


_library = None


def register() -> None:
    """Defines the op reference_vjp (CompositeImplicitAutograd: this module's Python)."""
    global _library
    namespace = add_op_namespace_prefix(REFERENCE_VJP_OP).split("::")[0]
    _library = torch.library.Library(namespace, "FRAGMENT")
    _library.define(REFERENCE_VJP_SCHEMA)
    _library.impl(REFERENCE_VJP_OP, reference_vjp, "CompositeImplicitAutograd")
