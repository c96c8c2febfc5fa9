"""torch.autograd.gradcheck and gradgradcheck of every op with autograd (ltx_kernels.OPS; the FP8
ops have none) in float64 on the CPU, on the public op itself: its forward is the C twin computing
in double (linear_gelu, lora_linear: libtorch in double), its first derivatives the fused backward
op's C twin (linear_gelu, lora_linear: their GEMMs), its second derivatives the differentiable
evaluation that a backward with create_graph=True takes. Every input form of test_autograd.cases
(each broadcast form of the modulation tensors, upcast, no gate / weight / modulation, per-head,
token and half-width RoPE tables, halves, one or two LoRA adapters, ...) at a small size, fresh
random inputs, every float tensor float64 and requiring grad except RoPE tables (constant, as the
fused backward takes them; tables that require grad take the reference VJP, checked on their own).
Also the float64 forward against reference.<op>(compute_dtype=float64, round_output=False), with
the fp32 operands the op takes beside a float64 x too."""

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference
from test_autograd import _map_tensors, _tensors, cases

# Small enough that gradgradcheck (one first-order evaluation per input and output-gradient element)
# runs in a fraction of a second per case: S = FRAMES (the per-frame form), odd D.
SIZES = dict(S=3, D=5, num_heads=2, head_dim=4)
# Argument indices of the RoPE tables.
TABLES = {"rope": {1, 2}, "qk_rmsnorm_rope": {4, 5}}
# gradcheck's comparison of the analytical Jacobian with the central differences (eps 1e-6), whose
# error is ~eps^2 |f'''| + 1e-16 |f| / eps ~ 1e-10 here: every case passes at atol 1e-9, rtol 1e-8
# and a quarter of the checks fail at 1e-10, 1e-9; 10x above that (gradcheck's defaults: 1e-5, 1e-3).
TOLERANCE = dict(atol=1e-8, rtol=1e-7)
# The float64 forward against the reference, relative to the output's magnitude: both evaluate the
# same formula in double, differing by summation order and eps, which the launchers take as a
# float (at most 5e-14 seen).
FORWARD_TOLERANCE = 1e-12


def _case_ids(op):
    return [case for case, _, _ in cases(op, torch.float64, "cpu", **SIZES)]


CASES = [
    pytest.param(op, case, id=f"{op}-{case}") for op in ltx_kernels.OPS for case in _case_ids(op)
]


def _case(op, case):
    """The args and kwargs of `case` (fresh random values at SIZES, as given: x float64, the
    case's fp32 operands fp32)."""
    for name, args, kwargs in cases(op, torch.float64, "cpu", **SIZES):
        if name == case:
            return args, kwargs
    raise AssertionError(f"no case {case} of {op}")


def _float64(args, constant=()):
    """args with every float tensor a float64 copy in the same layout (row strides kept; no two
    share memory, so gradcheck's perturbation of one leaves the others, such as wan's q and k
    weights, one tensor in the case, alone), requiring grad unless its argument index is in
    `constant`."""

    def copy(i, t):
        out = torch.empty_strided(t.shape, t.stride(), dtype=torch.float64)
        return out.copy_(t).requires_grad_(i not in constant)

    return _map_tensors(args, copy)


def _as_function(op, args, kwargs):
    """(fn, inputs): fn(*inputs) is ltx_kernels.<op>(*args, **kwargs) with args' tensors that
    require grad taken from its arguments."""
    inputs = [t for t in _tensors(args) if t.requires_grad]

    def fn(*values):
        values = iter(values)
        full = _map_tensors(args, lambda _, t: next(values) if t.requires_grad else t)
        return getattr(ltx_kernels, op)(*full, **kwargs)

    return fn, inputs


@pytest.mark.parametrize("op, case", CASES)
def test_gradcheck(op, case):
    args, kwargs = _case(op, case)
    fn, inputs = _as_function(op, _float64(args, TABLES.get(op, ())), kwargs)
    assert torch.autograd.gradcheck(fn, inputs, **TOLERANCE)


@pytest.mark.parametrize("op, case", CASES)
def test_gradgradcheck(op, case):
    args, kwargs = _case(op, case)
    fn, inputs = _as_function(op, _float64(args, TABLES.get(op, ())), kwargs)
    assert torch.autograd.gradgradcheck(fn, inputs, **TOLERANCE)


@pytest.mark.parametrize("op", sorted(TABLES))
def test_tables_requiring_grad(op):
    """cos and sin requiring grad take the reference VJP (differentiable again): both checks with
    every tensor requiring grad, in the first case of each op."""
    case = _case_ids(op)[0]
    args, kwargs = _case(op, case)
    fn, inputs = _as_function(op, _float64(args), kwargs)
    assert torch.autograd.gradcheck(fn, inputs, **TOLERANCE)
    assert torch.autograd.gradgradcheck(fn, inputs, **TOLERANCE)


def _assert_matches_reference(op, args, kwargs, what):
    outputs = getattr(ltx_kernels, op)(*args, **kwargs)
    expected = getattr(reference, op)(
        *args, **kwargs, compute_dtype=torch.float64, round_output=False
    )
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for index, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert got.dtype == torch.float64 and got.shape == want.shape, f"{what} output {index}"
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error <= FORWARD_TOLERANCE, f"{what} output {index}: relative error {error:.3g}"


@pytest.mark.parametrize("op, case", CASES)
def test_float64_forward_matches_reference(op, case):
    """Every tensor float64, then as the case gives them: a float64 x with the fp32 operands the
    op takes beside it (upcast modulation, RoPE tables, a q/k weight), loaded exactly; rmsnorm
    takes a float64 weight only (its output has the weight's dtype)."""
    args, kwargs = _case(op, case)
    with torch.no_grad():
        _assert_matches_reference(op, _float64(args), kwargs, f"{op}[{case}] float64")
        if all(t.dtype == torch.float64 for t in _tensors(args)):
            return
        if op == "rmsnorm":
            with pytest.raises(
                RuntimeError,
                match="ltx_kernels.rmsnorm: weight must have x's dtype float64, got float32",
            ):
                ltx_kernels.rmsnorm(*args, **kwargs)
            return
        _assert_matches_reference(op, args, kwargs, f"{op}[{case}] with fp32 operands")


@pytest.mark.parametrize("op", ["rmsnorm_modulate_quant", "add_layernorm_modulate_quant"])
def test_quant_ops_refuse_float64(op):
    """The quantized-output ops (inference, no backward to check) keep to the model dtypes."""
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    residual = (x,) if op.startswith("add_") else ()
    with pytest.raises(
        RuntimeError, match=f"ltx_kernels.{op}: x must be float32, float16 or bfloat16, got float64"
    ):
        getattr(ltx_kernels, op)(x, *residual, None, None)
