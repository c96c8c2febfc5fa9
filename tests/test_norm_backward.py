"""The fused backward of the norm ops and gated_residual (ltx_kernels.norm_modulate_backward, CUDA
kernel and C twin), beyond test_autograd.py's small cases: rows long enough for many chunks per
group and groups of every broadcast form, 16-byte and scalar paths, every dtype, against float64
evaluations of the VJP; torch.autograd.gradcheck in float64 on the C twin's float64 path; only the
gradients asked for; determinism; the reference fallback for rows the CUDA kernel does not take;
opcheck and bad inputs; autograd of every op calls the fused op."""

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference
from ltx_kernels._op_names import FUSED_BACKWARD_OPS
from ltx_kernels._op_namespace import ops

from helpers import BROADCASTS, DTYPES, FRAMES, make_activation, make_modulation, OpNames

NORM_OPS = [op for op, bwd in FUSED_BACKWARD_OPS.items() if bwd == "norm_modulate_backward"]
# Relative L2 error of each gradient against the float64 VJP: the kernel computes in fp32 and
# rounds each gradient once (to bf16: 2^-9 at most per element, about 2^-9/sqrt(3) in L2); fp32:
# sums over rows and the row reductions of a few thousand terms.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}


DX_ONLY = [True] + [False] * 6  # norm_modulate_backward's output_mask: the gradient of x alone


def _backward(
    grad_out=None,
    grad_h=None,
    h=None,
    y=None,
    gate=None,
    scale=None,
    shift=None,
    weight=None,
    bias=None,
    layer_norm=False,
    mask=DX_ONLY,
):
    """norm_modulate_backward's positional arguments (eps 1e-6), given by keyword."""
    return (grad_out, grad_h, h, y, gate, scale, shift, weight, bias, 1e-6, layer_norm, list(mask))


def _args(op, kind, x, y, dtype, device, with_affine=True):
    """Positional args of `op` for broadcast form `kind` (x, y already viewed for it)."""
    b, s, d = x.shape[0], x.shape[1] * (FRAMES if kind == "frames" else 1), x.shape[-1]
    weight = (0.3 * torch.randn(d, device=device)).add(1).to(dtype) if with_affine else None
    bias = (0.3 * torch.randn(d, device=device)).to(dtype) if with_affine else None
    if op == "rmsnorm":
        return (x, weight)
    if op == "gated_residual":
        (gate,) = make_modulation(kind, b, s, d, dtype, device, 1)
        return (x, y, gate)
    count = 3 if op.startswith("add_") else 2
    mods = make_modulation(kind, b, s, d, dtype, device, count)
    if op == "rmsnorm_modulate":
        return (x, *mods, weight)
    if op == "layernorm_modulate":
        return (x, *mods, weight, bias)
    if op == "add_rmsnorm_modulate":
        return (x, y, *mods, weight)
    return (x, y, *mods, weight, bias)


def _view(kind, t):
    return t.unflatten(1, (FRAMES, -1)) if kind == "frames" else t


def _grads(op, args, out_grads, float64):
    """Gradients of every tensor argument: the op's (fused backward) or float64 reference's."""
    leaves = [
        (a.detach().double() if float64 else a.detach()).requires_grad_()
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    ]
    if float64:
        outputs = getattr(reference, op)(*leaves, compute_dtype=torch.float64, round_output=False)
    else:
        outputs = getattr(ltx_kernels, op)(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    loss = sum((o.to(g.dtype) * g).sum() for o, g in zip(outputs, out_grads))
    return torch.autograd.grad(loss, tensors)


def _rel_l2(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _check(op, args, dtype, what):
    with torch.no_grad():
        outputs = getattr(ltx_kernels, op)(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    out_grads = [torch.randn(o.shape, device=o.device).to(o.dtype) for o in outputs]
    got = _grads(op, args, out_grads, float64=False)
    want = _grads(op, args, [g.double() for g in out_grads], float64=True)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for i, (t, g, w) in enumerate(zip(tensors, got, want)):
        assert g.shape == t.shape and g.dtype == t.dtype, f"{what} grad {i}: {g.shape}/{g.dtype}"
        error = _rel_l2(g, w)
        assert error <= TOLERANCE[dtype], f"{what} grad of tensor {i}: relative L2 {error:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", BROADCASTS)
@pytest.mark.parametrize("op", NORM_OPS)
def test_many_chunks_every_broadcast_form(device, op, kind, dtype):
    # 2 x 300 rows: groups of 300 (B1D), 100 (frames) or all rows (D), cut into many chunks, the
    # last one of each group shorter; hidden 256 (16-byte path) on strided rows.
    if op == "rmsnorm" and kind != "D":
        pytest.skip("rmsnorm has no modulation")
    x = make_activation((2, 300, 256), dtype, device, "row_strided")
    y = torch.randn(2, 300, 256, device=device).to(dtype)
    args = _args(op, kind, _view(kind, x), _view(kind, y), dtype, device)
    _check(op, args, dtype, f"{op}[{kind}] {dtype}")


@pytest.mark.parametrize("hidden", [37, 1000, 2048, 5120, 8192])
@pytest.mark.parametrize("op", ["add_layernorm_modulate", "rmsnorm_modulate", "rmsnorm"])
def test_hidden_sizes(device, op, hidden):
    # The scalar path (37, 1000: not a multiple of 8), and the model widths up to the CUDA limit.
    if device == "cpu" and hidden > 2048:
        pytest.skip("CPU: the C twin has no size limit; the wide rows are the CUDA kernel's")
    dtype = torch.bfloat16
    x = make_activation(
        (2, 40, hidden), dtype, device, "misaligned" if hidden == 37 else "contiguous"
    )
    y = torch.randn(2, 40, hidden, device=device).to(dtype)
    _check(op, _args(op, "B1D", x, y, dtype, device), dtype, f"{op} hidden {hidden}")


@pytest.mark.gpu
def test_rows_above_the_cuda_limit_take_the_reference():
    x = torch.randn(3, 8200, device="cuda").to(torch.bfloat16)
    scale, shift = make_modulation("D", 3, 1, 8200, torch.bfloat16, "cuda", 2)
    _check("rmsnorm_modulate", (x, scale, shift), torch.bfloat16, "hidden 8200")
    with pytest.raises(
        RuntimeError, match="norm_modulate_backward: the CUDA kernel takes rows of up"
    ):
        ops.norm_modulate_backward(*_backward(grad_out=x, h=x))


@pytest.mark.parametrize("op", NORM_OPS)
def test_upcast_fp32_operands(device, op):
    # Wan's form: bf16 activations with fp32 modulation, weight and bias (upcast=True).
    x = make_activation((2, 60, 128), torch.bfloat16, device, "row_strided")
    y = torch.randn(2, 60, 128, device=device).to(torch.bfloat16)
    args = list(_args(op, "unbind6", x, y, torch.float32, device))
    args[0] = x
    if op.startswith("add_") or op == "gated_residual":
        args[1] = y
    if op == "rmsnorm":
        pytest.skip("rmsnorm with an fp32 weight and bf16 x takes the reference (fp32 output)")
    kwargs = {"upcast": True}
    with torch.no_grad():
        outputs = getattr(ltx_kernels, op)(*args, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    out_grads = [torch.randn(o.shape, device=device).to(o.dtype) for o in outputs]
    leaves = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    outs = getattr(ltx_kernels, op)(*leaves, **kwargs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    got = torch.autograd.grad(
        sum((o.float() * g).sum() for o, g in zip(outs, out_grads)),
        [a for a in leaves if isinstance(a, torch.Tensor)],
    )
    leaves64 = [
        a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args
    ]
    outs64 = getattr(reference, op)(
        *leaves64, upcast=True, compute_dtype=torch.float64, round_output=False
    )
    outs64 = outs64 if isinstance(outs64, tuple) else (outs64,)
    want = torch.autograd.grad(
        sum((o * g.double()).sum() for o, g in zip(outs64, out_grads)),
        [a for a in leaves64 if isinstance(a, torch.Tensor)],
    )
    for i, (t, g, w) in enumerate(zip([a for a in args if isinstance(a, torch.Tensor)], got, want)):
        assert g.dtype == t.dtype
        # fp32 operands' gradients are fp32 sums, except in the add_ ops: their h is rounded to
        # bf16 in the forward (the gradients at that h differ from the float64 ones at the exact
        # x + y * gate by its rounding).
        exact_h = not op.startswith("add_")
        tolerance = 1e-5 if t.dtype == torch.float32 and exact_h else TOLERANCE[torch.bfloat16]
        assert _rel_l2(g, w) <= tolerance, f"{op} upcast grad {i}: {_rel_l2(g, w):.3g}"


def _fused_function(op, kwargs):
    """op's forward as its float64 reference with norm_modulate_backward as its backward, called
    as autograd_ops.cpp calls it (h saved, every gradient asked for), so gradcheck checks the
    backward op's C twin (its float64 path) alone against finite differences (the op itself, its
    forward C twin in float64 too: test_gradcheck.py)."""
    schema = getattr(ops, op).default._schema
    names = [a.name for a in schema.arguments if not a.kwarg_only]
    residual = "y" in names
    gradients = ("x", "y", "gate", "scale", "shift", "weight", "bias")

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            return getattr(reference, op)(
                *args, **kwargs, compute_dtype=torch.float64, round_output=False
            )

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.args = dict(zip(names, inputs))
            ctx.h = (output[0] if residual else inputs[0]) if op != "gated_residual" else None

        @staticmethod
        def backward(ctx, *grads):
            a = ctx.args
            grad_n = grads[-1] if op != "gated_residual" else None
            grad_h = grads[0] if residual else None
            mask = [a.get(n) is not None for n in gradients]
            computed = dict(
                zip(
                    gradients,
                    ops.norm_modulate_backward(
                        grad_n,
                        grad_h,
                        ctx.h,
                        *(a.get(n) for n in gradients[1:]),
                        a.get("eps", 1e-6),
                        "layernorm" in op,
                        mask
                        if grad_n is not None
                        else [False, *mask[1:3], False, False, False, False],
                    ),
                )
            )
            if grad_n is None:
                computed["x"] = grad_h
            return tuple(
                computed.get(n) if n in gradients and a.get(n) is not None else None for n in names
            )

    return Fused.apply


@pytest.mark.parametrize("kind", ["D", "B1D", "BSD", "frames"])
@pytest.mark.parametrize("op", NORM_OPS)
def test_gradcheck_float64_on_the_c_backend(op, kind):
    if op == "rmsnorm" and kind != "D":
        pytest.skip("rmsnorm has no modulation")
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    y = torch.randn(2, 6, 5, dtype=torch.float64)
    args = _args(op, kind, _view(kind, x), _view(kind, y), torch.float64, "cpu")
    args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
    fn = _fused_function(op, {})
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("op", NORM_OPS)
def test_only_the_wanted_gradients(device, op):
    # LoRA: only x requires grad; the kernel is asked for dx alone and gives the same dx.
    dtype = torch.float32
    x = torch.randn(2, 50, 64, device=device)
    y = torch.randn(2, 50, 64, device=device)
    args = _args(op, "B1D", x, y, dtype, device)
    outputs = getattr(ltx_kernels, op)(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    out_grads = [torch.randn_like(o) for o in outputs]
    every = _grads(op, args, out_grads, float64=False)
    leaf = x.clone().requires_grad_()
    outs = getattr(ltx_kernels, op)(leaf, *args[1:])
    outs = outs if isinstance(outs, tuple) else (outs,)
    (only_x,) = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, out_grads)), leaf)
    torch.testing.assert_close(only_x, every[0], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["add_rmsnorm_modulate", "layernorm_modulate"])
def test_deterministic(op):
    x = torch.randn(2, 700, 512, device="cuda").to(torch.bfloat16)
    y = torch.randn_like(x)
    args = _args(op, "B1D", x, y, torch.bfloat16, "cuda")
    outputs = getattr(ltx_kernels, op)(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    out_grads = [torch.randn_like(o) for o in outputs]
    first = _grads(op, args, out_grads, float64=False)
    for _ in range(3):
        again = _grads(op, args, out_grads, float64=False)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("op", NORM_OPS)
def test_autograd_runs_the_fused_backward(device, op):
    x = torch.randn(2, 9, 64, device=device).to(torch.bfloat16)
    y = torch.randn_like(x)
    args = [
        a.requires_grad_() if isinstance(a, torch.Tensor) else a
        for a in _args(op, "B1D", x, y, torch.bfloat16, device)
    ]
    outputs = getattr(ltx_kernels, op)(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    with OpNames() as seen:
        torch.autograd.grad(
            outputs,
            [a for a in args if isinstance(a, torch.Tensor)],
            [torch.randn_like(o) for o in outputs],
        )
    assert "ltx_kernels::norm_modulate_backward" in seen.names, sorted(seen.names)
    # No reference VJP: no elementwise aten math on full rows besides the op.
    assert "aten::rsqrt" not in seen.names, sorted(seen.names)


def test_create_graph_takes_a_differentiable_evaluation(device):
    # create_graph=True through an add_ op: the first derivatives come from the reference VJP at
    # the saved h and the residual's part in ATen (differentiable again; values against float64:
    # test_autograd.py, test_gradcheck.py), not from the fused op, whose outputs are not
    # differentiable (differentiated directly, it raises naming itself); without create_graph from
    # the fused op alone. Both agree.
    x, y = (torch.randn(2, 6, 16, device=device, requires_grad=True) for _ in range(2))
    scale, shift, gate = make_modulation("B1D", 2, 6, 16, torch.float32, device, 3)
    h, n = ltx_kernels.add_rmsnorm_modulate(x, y, scale, shift, gate)
    loss = n.sum() + (h * h).sum()
    with OpNames() as seen:
        want = torch.autograd.grad(loss, (x, y), retain_graph=True)
    assert "ltx_kernels::norm_modulate_backward" in seen.names, sorted(seen.names)
    with OpNames() as seen:
        gx, gy = torch.autograd.grad(loss, (x, y), create_graph=True)
    assert "ltx_kernels::norm_modulate_backward" not in seen.names, sorted(seen.names)
    assert _rel_l2(gx, want[0]) <= 1e-6 and _rel_l2(gy, want[1]) <= 1e-6
    assert all(g is not None for g in torch.autograd.grad((gx * gx).sum(), (x, y)))
    grad_out = torch.randn_like(x, requires_grad=True)
    dx = ops.norm_modulate_backward(*_backward(grad_out=grad_out, h=x))[0]
    with pytest.raises(
        RuntimeError, match="ltx_kernels.norm_modulate_backward is not differentiable"
    ):
        dx.sum().backward()


@pytest.mark.parametrize("layer_norm", [False, True])
def test_opcheck(device, layer_norm):
    x = torch.randn(2, 10, 32, device=device)
    y, grad_out, grad_h = (torch.randn_like(x) for _ in range(3))
    scale, shift, gate = make_modulation("B1D", 2, 10, 32, torch.float32, device, 3)
    weight = torch.randn(32, device=device)
    bias = torch.randn(32, device=device) if layer_norm else None
    op = ops.norm_modulate_backward.default
    mask = [True, True, True, True, True, True, layer_norm]
    torch.library.opcheck(
        op,
        _backward(grad_out, grad_h, x, y, gate, scale, shift, weight, bias, layer_norm, mask),
    )
    torch.library.opcheck(
        op, _backward(grad_h=grad_h, y=y, gate=gate, mask=[False, True, True] + [False] * 4)
    )


def test_bad_inputs(device):
    x = torch.randn(2, 8, 16, device=device)

    def raises(match, **arguments):
        with pytest.raises(RuntimeError, match=f"norm_modulate_backward: {match}"):
            ops.norm_modulate_backward(*_backward(**arguments))

    raises("needs grad_out or grad_h", h=x)
    raises("grad_out needs h", grad_out=x)
    raises("y must have h's shape", grad_out=x, h=x, y=x[:, :4])
    raises(
        "the gradient of gate needs y",
        grad_out=x,
        h=x,
        gate=x,
        mask=[False, False, True] + [False] * 4,
    )
    raises("grad_out must have h's dtype", grad_out=x.half(), h=x)
    raises("scale with shape", grad_out=x, h=x, scale=torch.randn(3, 1, 16, device=device))
    raises("bias is only allowed with norm", grad_out=x, h=x, bias=torch.randn(16, device=device))
    if device == "cuda":
        raises("h is float64, which only the CPU backend takes", grad_out=x.double(), h=x.double())
