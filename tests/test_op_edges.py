"""The edges of the op bindings (torch-ext/*.cpp), for every public op: modulation tensors and RoPE
tables broadcast to 5-dim activations in forms with more levels than the launchers' rows
(LTX_MAX_ROW_DIMS; the binding copies such an operand once), expanded output gradients (stride-0
dims, 5 dims, y.sum() and broadcasting losses), an empty inner or output dim of the GEMM ops
(K = 0, N = 0), an empty head_dim, empty tensors in each dim, and torch's dtype names in error
messages. Values against reference.py: float64 (CPU) within test_gradcheck's FORWARD_TOLERANCE,
float32 within test_norm_modulate's rounding bounds, and bit for bit against the same call with
every operand made contiguous; gradients against the float64 VJP within test_autograd's
GRAD_TOLERANCE, and torch.autograd.gradcheck in float64 on the CPU."""

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference

from helpers import assert_rounds_within, make_activation
from test_attention_int8 import make_operands
from test_autograd import GRAD_TOLERANCE, _map_tensors, _rel_l2, _tensors
from test_gradcheck import FORWARD_TOLERANCE, TOLERANCE as GRADCHECK_TOLERANCE
from test_norm_modulate import NormCase, run_and_check

B, F, H, W, C = 2, 3, 2, 4, 8  # x [B, F, H, W, C]: frames of H x W tokens, C channels
SHAPE = (B, F, H, W, C)
# Broadcast forms of a modulation tensor against SHAPE (the second and third have four row levels
# once expanded: more than the launchers' three, so the binding copies them).
FORMS = {
    "C": (C,),
    "B1111C": (B, 1, 1, 1, C),
    "BF11C": (B, F, 1, 1, C),
    "B1H1C": (B, 1, H, 1, C),
    "1F1WC": (1, F, 1, W, C),
    "F1WC": (F, 1, W, C),
    "11HWC": (1, 1, H, W, C),
    "BFHWC": SHAPE,
}
NORM_OPS = [
    "rmsnorm_modulate",
    "layernorm_modulate",
    "add_rmsnorm_modulate",
    "add_layernorm_modulate",
]
QUANT_OPS = [f"{op}_quant" for op in NORM_OPS]
# float64 runs on the C twins only; gradients of float64 against the float64 VJP: the same formula
# in double (as FORWARD_TOLERANCE).
GRAD_TOLERANCE = {**GRAD_TOLERANCE, torch.float64: 1e-12}


def _dtypes(device):
    return [torch.float32] + ([torch.float64] if device == "cpu" else [])


def _modulation(form, dtype, device, strided=False):
    """A modulation tensor of broadcast form `form`, values N(0, 0.25); strided: a view of every
    other channel group of a wider tensor (rows not contiguous)."""
    shape = FORMS[form]
    if strided:
        return (0.5 * torch.randn(*shape[:-1], 3, shape[-1], device=device)).to(dtype)[..., 1, :]
    return (0.5 * torch.randn(shape, device=device)).to(dtype)


def _contiguous_operands(args, like):
    """args with each broadcast operand (at least 2-D, fewer elements than `like`) expanded to
    like's shape and made contiguous (a layout the launchers describe without a copy)."""

    def one(_, t):
        if t.dim() >= 2 and t.numel() < like.numel() and t.shape[-1] == like.shape[-1]:
            return t.expand(like.shape).contiguous()
        return t

    return _map_tensors(args, one)


def _norm_args(op, form, dtype, device, strided=False):
    """(args, x) of a norm op or gated_residual on a row-strided 5-dim x, modulation of `form`."""
    x = make_activation(SHAPE, dtype, device, "row_strided")
    y = torch.randn(SHAPE, device=device).to(dtype)
    scale, shift, gate = (_modulation(form, dtype, device, strided) for _ in range(3))
    weight = (1 + 0.3 * torch.randn(C, device=device)).to(dtype)
    bias = (0.3 * torch.randn(C, device=device)).to(dtype)
    base = op.removesuffix("_quant")
    if base == "gated_residual":
        return [x, y, gate], x
    args = [x, y] if base.startswith("add_") else [x]
    args += [scale, shift] + ([gate] if base.startswith("add_") else []) + [weight]
    return args + ([bias] if "layernorm" in base else []), x


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _assert_float64_matches(op, args, kwargs, what):
    """ltx_kernels.<op> in float64 against reference.<op> in float64 (no rounding)."""
    got = _as_tuple(getattr(ltx_kernels, op)(*args, **kwargs))
    want = _as_tuple(
        getattr(reference, op)(*args, **kwargs, compute_dtype=torch.float64, round_output=False)
    )
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} output {index}"
        if w.numel():
            error = ((g - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
            assert error <= FORWARD_TOLERANCE, f"{what} output {index}: relative error {error:.3g}"


def _assert_float32_matches(op, args, what):
    """float32 outputs within the rounding bounds of test_norm_modulate (norm ops) or of its h
    check (gated_residual: x + R(y * gate))."""
    if op == "gated_residual":
        x, y, gate = args
        out = ltx_kernels.gated_residual(x, y, gate)
        exact = reference.gated_residual(
            x, y, gate, compute_dtype=torch.float64, round_output=False
        )
        product = (y.double() * gate.double()).abs()
        assert_rounds_within(
            out,
            exact,
            what,
            roundings=1,
            magnitude=product,
            slop_magnitude=x.double().abs() + product,
        )
        return
    names = ["x"] + (["y"] if op.startswith("add_") else []) + ["scale", "shift"]
    names += (["gate"] if op.startswith("add_") else []) + ["weight"]
    names += ["bias"] if "layernorm" in op else []
    run_and_check(NormCase(op, **dict(zip(names, args))), what)


# ------------------------------------------------------------------------------------------------
# Broadcast operands with more levels than the launchers' rows
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", NORM_OPS + ["gated_residual"])
def test_broadcast_forms_of_5dim_activations(device, op, form, strided):
    for dtype in _dtypes(device):
        args, x = _norm_args(op, form, dtype, device, strided)
        what = f"{op} {form} {dtype}"
        if dtype == torch.float64:
            _assert_float64_matches(op, args, {}, what)
        else:
            _assert_float32_matches(op, args, what)
        # bit for bit the call whose operands the launchers describe in place
        got = _as_tuple(getattr(ltx_kernels, op)(*args))
        want = _as_tuple(getattr(ltx_kernels, op)(*_contiguous_operands(args, x)))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("format", ["e4m3_row", "i8_row"])
@pytest.mark.parametrize("form", ["B1H1C", "1F1WC", "F1WC"])
@pytest.mark.parametrize("op", QUANT_OPS)
def test_broadcast_forms_of_quantized_ops(device, op, form, format):
    """The quantized ops' codes and scales, bit for bit those of the call with contiguous operands
    (whose values test_quant_ops checks against the reference)."""
    args, x = _norm_args(op, form, torch.float32, device)
    got = getattr(ltx_kernels, op)(*args, format=format)
    want = getattr(ltx_kernels, op)(*_contiguous_operands(args, x), format=format)
    for g, w in zip(got, want, strict=True):
        if g.element_size() == 1:  # (codes compared as bytes)
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        assert torch.equal(g, w), f"{op} {form} {format}"


@pytest.mark.parametrize("form", ["B1H1C", "1F1WC", "BF11C"])
@pytest.mark.parametrize("op", NORM_OPS + ["gated_residual"])
def test_gradients_of_broadcast_forms(device, op, form):
    """Every gradient (the operands' summed over their broadcast dims) against the float64 VJP."""
    for dtype in _dtypes(device):
        args, _ = _norm_args(op, form, dtype, device)
        leaves = _map_tensors(args, lambda _, t: t.detach().requires_grad_())
        outputs = _as_tuple(getattr(ltx_kernels, op)(*leaves))
        grads = [torch.randn_like(o) for o in outputs]
        got = torch.autograd.grad(outputs, _tensors(leaves), grads)
        leaves64 = _map_tensors(args, lambda _, t: t.detach().double().requires_grad_())
        want_out = _as_tuple(
            getattr(reference, op)(*leaves64, compute_dtype=torch.float64, round_output=False)
        )
        want = torch.autograd.grad(want_out, _tensors(leaves64), [g.double() for g in grads])
        for index, (t, g, w) in enumerate(zip(_tensors(leaves), got, want, strict=True)):
            what = f"{op} {form} {dtype} grad of tensor {index}"
            assert g.shape == t.shape and g.dtype == t.dtype, what
            assert _rel_l2(g, w) <= GRAD_TOLERANCE[dtype], f"{what}: {_rel_l2(g, w):.3g}"


@pytest.mark.parametrize("form", ["B1H1C", "1F1WC"])
@pytest.mark.parametrize("op", NORM_OPS + ["gated_residual"])
def test_gradcheck_of_broadcast_forms(op, form):
    """torch.autograd.gradcheck in float64 (C twins) on a small 5-dim x, [2, 3, 2, 2, 4]."""
    global_shape = (2, 3, 2, 2, 4)
    shapes = {"B1H1C": (2, 1, 2, 1, 4), "1F1WC": (1, 3, 1, 2, 4)}
    x, y = (torch.randn(global_shape, dtype=torch.float64) for _ in range(2))
    scale, shift, gate = (0.5 * torch.randn(shapes[form], dtype=torch.float64) for _ in range(3))
    weight, bias = (
        1 + 0.3 * torch.randn(4, dtype=torch.float64),
        torch.randn(4, dtype=torch.float64),
    )
    if op == "gated_residual":
        inputs = [x, y, gate]
    else:
        inputs = [x] + ([y] if op.startswith("add_") else []) + [scale, shift]
        inputs += ([gate] if op.startswith("add_") else []) + [weight]
        inputs += [bias] if "layernorm" in op else []
    inputs = [t.requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(getattr(ltx_kernels, op), inputs, **GRADCHECK_TOLERANCE)


def _rope_args(op, dtype, device, table_form):
    """rope / qk_rmsnorm_rope (per head) on a 5-dim [B, F, H, W, C] x, tables of table_form."""
    x = make_activation(SHAPE, dtype, device, "row_strided")
    angle = 6.3 * torch.rand(FORMS[table_form], device=device)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    if op == "rope":
        return [x, cos, sin, True], {}
    k = torch.randn(SHAPE, device=device).to(dtype)
    weight = (1 + 0.3 * torch.randn(C, device=device)).to(dtype)
    return [x, k, weight, weight.clone(), cos, sin], {"across_heads": False}


@pytest.mark.parametrize("table_form", ["1F1WC", "F1WC", "B1H1C", "BF11C"])
@pytest.mark.parametrize("op", ["rope", "qk_rmsnorm_rope"])
def test_rope_tables_of_5dim_activations(device, op, table_form):
    """cos/sin broadcast to a 5-dim x with four row levels: the float64 reference, and bit for bit
    the call with tables expanded and contiguous; gradients against the float64 VJP."""
    for dtype in _dtypes(device):
        args, kwargs = _rope_args(op, dtype, device, table_form)
        what = f"{op} {table_form} {dtype}"
        if dtype == torch.float64:
            _assert_float64_matches(op, args, kwargs, what)
        got = _as_tuple(getattr(ltx_kernels, op)(*args, **kwargs))
        tables = _contiguous_operands(args, args[0])
        want = _as_tuple(getattr(ltx_kernels, op)(*tables, **kwargs))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        _check_gradients(op, args, kwargs, dtype, what, constant={1, 2} if op == "rope" else {4, 5})


# ------------------------------------------------------------------------------------------------
# Expanded output gradients
# ------------------------------------------------------------------------------------------------
def _five_dim_case(op, dtype, device):
    """(args, kwargs) of `op` on a 5-dim x, its operands in four-level broadcast forms."""
    if op in NORM_OPS or op == "gated_residual":
        return _norm_args(op, "B1H1C", dtype, device)[0], {}
    if op in ("rope", "qk_rmsnorm_rope"):
        return _rope_args(op, dtype, device, "1F1WC")
    x = make_activation(SHAPE, dtype, device, "row_strided")
    if op == "rmsnorm":
        return [x, (1 + 0.3 * torch.randn(C, device=device)).to(dtype)], {}
    if op == "gelu":
        return [x, "tanh"], {}
    if op == "geglu":
        return [make_activation((*SHAPE[:-1], 2 * C), dtype, device, "row_strided"), "none"], {}
    weight = (C**-0.5 * torch.randn(6, C, device=device)).to(dtype)
    bias = torch.randn(6, device=device).to(dtype)
    if op == "linear_gelu":
        return [x, weight, bias], {}
    lora_a = [(C**-0.5 * torch.randn(2, C, device=device)).to(dtype)]
    lora_b = [(0.7 * torch.randn(3, 2, device=device)).to(dtype)]
    return [x, weight, bias, lora_a, lora_b, [0.5], [2]], {}


def _expanded_grads(kind, outputs):
    """Output gradients that autograd hands over expanded: "expand" (a [B, 1, H, 1, C] gradient
    broadcast: stride 0 in two of four leading dims), "sum" (y.sum(): stride 0 everywhere) and
    "broadcast_loss" ((y * w).sum() with w [1, F, 1, W, 1]: stride 0 in the last dim too)."""
    grads = []
    for o in outputs:
        if kind == "expand":
            small = torch.randn(o.shape[0], 1, o.shape[2], 1, o.shape[4], device=o.device)
            grads.append(small.to(o.dtype).expand(o.shape))
        elif kind == "sum":
            grads.append(torch.ones((), device=o.device, dtype=o.dtype).expand(o.shape))
        else:
            w = torch.randn(1, o.shape[1], 1, o.shape[3], 1, device=o.device)
            grads.append(w.to(o.dtype).expand(o.shape))
    return grads


def _check_gradients(op, args, kwargs, dtype, what, grad_kind="expand", constant=()):
    """The op's gradients for expanded output gradients: against the float64 VJP, and bit for bit
    those for the same gradients made contiguous (the GEMM ops: ATen's, whose GEMMs may take
    another summation order for another layout)."""
    leaves = _map_tensors(args, lambda i, t: t.detach().requires_grad_(i not in constant))
    wanted = [t for t in _tensors(leaves) if t.requires_grad]
    outputs = _as_tuple(getattr(ltx_kernels, op)(*leaves, **kwargs))
    grads = _expanded_grads(grad_kind, outputs)
    got = torch.autograd.grad(outputs, wanted, grads)
    outputs = _as_tuple(getattr(ltx_kernels, op)(*leaves, **kwargs))
    dense = torch.autograd.grad(outputs, wanted, [g.contiguous() for g in grads])
    leaves64 = _map_tensors(
        args, lambda i, t: t.detach().double().requires_grad_(i not in constant)
    )
    outputs64 = _as_tuple(
        getattr(reference, op)(*leaves64, **kwargs, compute_dtype=torch.float64, round_output=False)
    )
    wanted64 = [t for t in _tensors(leaves64) if t.requires_grad]
    want = torch.autograd.grad(outputs64, wanted64, [g.double() for g in grads])
    for index, (t, g, d, w) in enumerate(zip(wanted, got, dense, want, strict=True)):
        name = f"{what} grad of tensor {index}"
        assert g.shape == t.shape and g.dtype == t.dtype, name
        if op not in ("linear_gelu", "lora_linear"):
            torch.testing.assert_close(g, d, rtol=0, atol=0, msg=name)
        assert _rel_l2(g, w) <= GRAD_TOLERANCE[dtype], f"{name}: {_rel_l2(g, w):.3g}"


@pytest.mark.parametrize("kind", ["expand", "sum", "broadcast_loss"])
@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_expanded_output_gradients(device, op, kind):
    for dtype in _dtypes(device):
        args, kwargs = _five_dim_case(op, dtype, device)
        constant = {1, 2} if op == "rope" else {4, 5} if op == "qk_rmsnorm_rope" else ()
        _check_gradients(op, args, kwargs, dtype, f"{op} {kind} {dtype}", kind, constant)


# ------------------------------------------------------------------------------------------------
# Empty dims
# ------------------------------------------------------------------------------------------------
GEMM_SIZES = [(3, 0, 5), (3, 4, 0), (3, 0, 0), (0, 4, 5), (0, 0, 5)]  # (M, K, N)


def _gemm_args(op, m, k, n, bias, dtype, device):
    x = torch.randn(2, m, k, device=device).to(dtype)
    weight = torch.randn(n, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    if op == "linear_gelu":
        return [x, weight, b]
    lora_a = [torch.randn(2, k, device=device).to(dtype)]
    lora_b = [torch.randn(n, 2, device=device).to(dtype)]
    return [x, weight, b, lora_a, lora_b, [0.5], [0]]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("m, k, n", GEMM_SIZES)
@pytest.mark.parametrize("op", ["linear_gelu", "lora_linear"])
def test_empty_inner_and_output_dims(device, op, m, k, n, bias):
    """K = 0: out = gelu(bias or 0) (linear_gelu), bias or 0 (lora_linear); N = 0 or M = 0: an
    empty output; the gradients those of the float64 reference (zeros where they sum over an
    empty dim)."""
    for dtype in _dtypes(device):
        args = _gemm_args(op, m, k, n, bias, dtype, device)
        what = f"{op} M={m} K={k} N={n} {dtype}"
        out = getattr(ltx_kernels, op)(*args)
        assert out.shape == (2, m, n) and out.dtype == dtype, what
        if dtype == torch.float64:
            _assert_float64_matches(op, args, {}, what)
        else:
            want = getattr(reference, op)(*args)  # (K = 0: one rounding of gelu(bias) or bias)
            torch.testing.assert_close(out, want, rtol=0, atol=0, msg=what)
        leaves = _map_tensors(args, lambda _, t: t.detach().requires_grad_())
        out = getattr(ltx_kernels, op)(*leaves)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, _tensors(leaves), grad, allow_unused=True)
        leaves64 = _map_tensors(args, lambda _, t: t.detach().double().requires_grad_())
        out64 = getattr(reference, op)(*leaves64, compute_dtype=torch.float64, round_output=False)
        want = torch.autograd.grad(out64, _tensors(leaves64), grad.double(), allow_unused=True)
        for index, (t, g, w) in enumerate(zip(_tensors(leaves), got, want, strict=True)):
            w = torch.zeros_like(t, dtype=torch.float64) if w is None else w
            assert g is not None and g.shape == t.shape and g.dtype == t.dtype, f"{what} {index}"
            tolerance = GRAD_TOLERANCE[dtype] * max(1.0, w.norm().item())
            assert (g.double() - w).norm().item() <= tolerance, f"{what} grad {index}"
    if device == "cpu" and m * n:  # gradcheck where the output has elements
        args = _map_tensors(
            _gemm_args(op, m, k, n, bias, torch.float64, "cpu"), lambda _, t: t.requires_grad_()
        )
        inputs = _tensors(args)

        def fn(*values):
            values = iter(values)
            return getattr(ltx_kernels, op)(*_map_tensors(args, lambda _, t: next(values)))

        assert torch.autograd.gradcheck(fn, inputs, **GRADCHECK_TOLERANCE)


@pytest.mark.parametrize("tables", [True, False], ids=["rope", "no_rope"])
@pytest.mark.parametrize("across_heads", [True, False])
def test_empty_head_dim(device, across_heads, tables):
    """head_dim 0: empty outputs (and one scale per head of the quantized q: an empty row's), empty
    gradients, no error."""
    q, k = (torch.randn(2, 3, 4, 0, device=device) for _ in range(2))
    weight_len = 0
    weights = (torch.ones(weight_len, device=device),) * 2
    cos, sin = (torch.randn(3, 0, device=device),) * 2 if tables else (None, None)
    kwargs = {"across_heads": across_heads}
    q_out, k_out = ltx_kernels.qk_rmsnorm_rope(q, k, *weights, cos, sin, **kwargs)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    codes, scale, k_out = ltx_kernels.qk_rmsnorm_rope_quant(q, k, *weights, cos, sin, **kwargs)
    want_codes, want_scale, _ = reference.qk_rmsnorm_rope_quant(q, k, *weights, cos, sin, **kwargs)
    assert codes.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    leaves = [t.clone().requires_grad_() for t in (q, k, *weights)]
    outputs = ltx_kernels.qk_rmsnorm_rope(*leaves, cos, sin, **kwargs)
    (outputs[0].sum() + outputs[1].sum()).backward()
    for t in leaves:
        assert t.grad is not None and t.grad.shape == t.shape
    if tables:
        x = q.clone().requires_grad_()
        out = ltx_kernels.rope(x, cos, sin)
        out.sum().backward()
        assert out.shape == q.shape and x.grad.shape == q.shape


def _slice_dim(args, dim, like):
    """args with dim `dim` of every tensor whose dims line up with `like`'s (x and the operands
    broadcast to it, size > 1 in that dim) sliced to 0."""

    def one(_, t):
        offset = t.dim() - like.dim()
        d = dim + offset if dim >= 0 else dim
        if t.dim() >= 1 and 0 <= d < t.dim() and t.shape[d] == like.shape[dim] and t.shape[d] > 1:
            return t.narrow(d, 0, 0)
        return t

    return _map_tensors(args, one)


@pytest.mark.parametrize("dim", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_empty_tensors_in_each_dim(device, op, dim):
    """Each dim of the 5-dim case sliced to 0 in x and the operands that span it (the last dim:
    the channels of x, weights and tables): outputs of the float64 reference's shape, gradients of
    each input's shape, zero where the input is not empty (a sum over no rows)."""
    args, kwargs = _five_dim_case(op, torch.float32, device)
    x = args[0]
    if dim == 4 and op in ("geglu", "rope", "qk_rmsnorm_rope"):
        pytest.skip("an empty last dim of these is test_empty_head_dim's / has no halves")
    empty = _slice_dim(args, dim, x)
    constant = {1, 2} if op == "rope" else {4, 5} if op == "qk_rmsnorm_rope" else ()
    leaves = _map_tensors(empty, lambda i, t: t.detach().requires_grad_(i not in constant))
    outputs = _as_tuple(getattr(ltx_kernels, op)(*leaves, **kwargs))
    want = _as_tuple(getattr(reference, op)(*leaves, **kwargs))
    for o, w in zip(outputs, want, strict=True):
        assert o.shape == w.shape and o.dtype == w.dtype
    wanted = [t for t in _tensors(leaves) if t.requires_grad]
    grads = torch.autograd.grad(
        sum(o.sum() for o in outputs), wanted, allow_unused=True, materialize_grads=True
    )
    for t, g in zip(wanted, grads, strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype
        if op not in ("linear_gelu", "lora_linear") or t.numel() == 0:
            assert torch.count_nonzero(g) == 0


# ------------------------------------------------------------------------------------------------
# Error messages name dtypes as torch does
# ------------------------------------------------------------------------------------------------
def _bad_dtype_calls():
    x = torch.randn(2, 3, 8)
    ok = make_operands(1, 4, 6, 2, 64, "cpu")  # (q8, q_scale, k8, k_scale, v8, v_scale)
    q8, v8 = ok[0], ok[4]
    return [
        ("x must be .*, got int8", lambda: ltx_kernels.rmsnorm(x.to(torch.int8))),
        (
            "weight must be float32, float16 or bfloat16, got float64",
            lambda: ltx_kernels.rmsnorm(x, torch.ones(8, dtype=torch.float64)),
        ),
        (
            "scale must have x's dtype float32 .*, got bfloat16",
            lambda: ltx_kernels.rmsnorm_modulate(x, x[0, 0].bfloat16(), None),
        ),
        (
            "scale must be float16 or float32, got bfloat16",
            lambda: ltx_kernels.rmsnorm_modulate(x.half(), x[0, 0].bfloat16(), None, upcast=True),
        ),
        (
            "weight must have x's dtype float64, got float32",
            lambda: ltx_kernels.linear_gelu(x.double(), torch.ones(4, 8)),
        ),
        ("q8 must be int8", lambda: ltx_kernels.attention_int8(q8.float(), *ok[1:])),
        (
            "v8 must be float8_e4m3fn",
            lambda: ltx_kernels.attention_int8(*ok[:4], v8.view(torch.int8), ok[5]),
        ),
    ]


C10_NAMES = ["Char", "Double", "Float", "Half", "BFloat16", "Float8_e4m3fn", "Int", "Long"]


@pytest.mark.parametrize("index", range(len(_bad_dtype_calls())))
def test_error_messages_name_torch_dtypes(index):
    match, call = _bad_dtype_calls()[index]
    with pytest.raises(RuntimeError, match=match) as error:
        call()
    words = str(error.value).replace(",", " ").replace("'", " ").split()
    assert not set(words) & set(C10_NAMES), str(error.value)
