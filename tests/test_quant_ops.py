"""The quantized-output ops (ltx_kernels.QUANT_OPS) in their format "e4m3_row" on CPU and CUDA. Each
must return exactly the rowwise quantization (reference.quantize_rows: scales bit-exact, e4m3 values the correctly rounded
ones) of the value its model-dtype twin returns, which test_norm_modulate.py and
test_residual_activations.py check against float64; the add_ ops' h must be that op's h bit for
bit. Also: the e4m3 rounding itself against torch's conversion (every value, every tie), zero and
NaN rows, every dtype, odd and long rows (the streaming kernels), strided and misaligned rows,
every broadcast form, empty tensors, opcheck, torch.compile, CUDA graphs, no backward, bad
inputs."""

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference

from helpers import (
    BROADCASTS,
    DTYPES,
    LAYOUTS,
    assert_compiles_once,
    assert_graph_replays_outputs,
    make_activation,
)
from test_norm_modulate import OPS as NORM_OPS
from test_norm_modulate import make_case

# (activation, approximate) of quantize
ACTIVATIONS = [("none", "none"), ("gelu", "none"), ("gelu", "tanh")]
# The scale of a row whose amax is 0 (fp32: 1e-12 / 448).
ZERO_ROW_SCALE = (torch.tensor(reference.MIN_AMAX) / reference.E4M3_MAX).item()
# Odd rows (scalar tails), model widths, the longest cached row (8192 bf16 for the norm ops, 16384
# for quantize) and longer rows (the streaming kernels).
NORM_SHAPES = [(1, 111), (7, 2048), (5, 5125), (3, 8192), (2, 9000), (4096, 2048)]
QUANTIZE_SHAPES = [(1, 111), (7, 2048), (5, 8192), (3, 13824), (2, 16384), (2, 20000), (4096, 2048)]


def _skip_big_on_cpu(device, shape):
    if device == "cpu" and shape[0] >= 4096:
        pytest.skip("4096 rows run on CUDA only (the CPU twin's rows are independent)")


def assert_exact_e4m3(q, q_scale, value, what):
    """(q, q_scale) is exactly reference.quantize_rows(value, "e4m3_row")."""
    ref_q, ref_scale = reference.quantize_rows(value)
    assert q.dtype == torch.float8_e4m3fn and q_scale.dtype == torch.float32, what
    assert q.shape == value.shape and q_scale.shape == value.shape[:-1], what
    assert q.is_contiguous() and q_scale.is_contiguous(), what
    assert torch.equal(q_scale, ref_scale) or torch.allclose(
        q_scale, ref_scale, rtol=0, atol=0, equal_nan=True
    ), f"{what}: row scales differ ({(q_scale != ref_scale).sum().item()} rows)"
    differ = q.view(torch.uint8) != ref_q.view(torch.uint8)
    assert not differ.any(), f"{what}: {differ.sum().item()} e4m3 values differ"
    # The rule itself: q * scale is within half an e4m3 step of the value (3 mantissa bits; the
    # subnormal step 2^-9 below 2^-6, in units of the row scale).
    v = value.double()
    error = (reference.dequantize_rows(q, q_scale, torch.float64) - v).abs()
    bound = 2.0**-4 * v.abs() + 2.0**-10 * q_scale.double().unsqueeze(-1)
    assert (error <= bound).all(), f"{what}: dequantized values off by more than half a step"


# ------------------------------------------------------------------------------------------------
# The e4m3 conversion and the scale rule
# ------------------------------------------------------------------------------------------------
def _every_e4m3_value_and_tie():
    """Every finite e4m3 value, the midpoints between neighbours (ties round to even) and points
    just off them, as fp32, in one row whose amax is 448 (scale 1: the row is quantized as is)."""
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    nudge = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    below = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    row = torch.cat([finite, mids, nudge, below, torch.tensor([447.9, 448.0])])
    return row[None]


@pytest.mark.parametrize("dtype", [torch.float32])
def test_e4m3_rounding_of_every_value_and_tie(device, dtype):
    row = _every_e4m3_value_and_tie().to(device, dtype)
    q, q_scale = ltx_kernels.quantize(row)
    assert q_scale.item() == 1.0
    expected = row.clamp(-448, 448).to(torch.float8_e4m3fn)  # torch: round to nearest even
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def test_zero_nan_and_huge_rows(device):
    x = torch.randn(4, 64, device=device)
    x[0] = 0
    x[1, 5] = float("nan")
    x[2] *= 1e30
    x[3, :32] = 1e-30  # below e4m3's subnormals once scaled
    q, q_scale = ltx_kernels.quantize(x)
    ref_q, ref_scale = reference.quantize_rows(x)
    assert q_scale[0].item() == ZERO_ROW_SCALE
    assert (q[0].float() == 0).all()
    assert torch.isnan(q_scale[1]) and torch.isnan(q[1].float()).all()
    assert torch.equal(q_scale[[0, 2, 3]], ref_scale[[0, 2, 3]])
    assert torch.equal(q[[0, 2, 3]].view(torch.uint8), ref_q[[0, 2, 3]].view(torch.uint8))


# ------------------------------------------------------------------------------------------------
# quantize
# ------------------------------------------------------------------------------------------------
def _activated(x, activation):
    """The value quantize quantizes, from our own gelu op (the same GELU code per device)."""
    kind, approximate = activation
    return x if kind == "none" else ltx_kernels.gelu(x, approximate)


@pytest.mark.parametrize("shape", QUANTIZE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_quantize(device, activation, dtype, shape):
    _skip_big_on_cpu(device, shape)
    x = (3 * torch.randn(shape, device=device)).to(dtype)
    q, q_scale = ltx_kernels.quantize(x, *activation)
    assert_exact_e4m3(q, q_scale, _activated(x, activation), f"quantize{activation}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_strided_rows(device, dtype, layout):
    x = make_activation((3, 5, 2048), dtype, device, layout)
    q, q_scale = ltx_kernels.quantize(x, "gelu", "tanh")
    assert_exact_e4m3(q, q_scale, _activated(x, ("gelu", "tanh")), layout)


def test_quantize_of_a_linear_weight(device):
    """Per output channel: the rows of a [N, K] weight."""
    weight = torch.randn(96, 64, device=device).to(torch.bfloat16)
    q, q_scale = ltx_kernels.quantize(weight)
    assert q_scale.shape == (96,)
    assert_exact_e4m3(q, q_scale, weight, "weight")


# ------------------------------------------------------------------------------------------------
# The norm ops' quantized forms
# ------------------------------------------------------------------------------------------------
def _run_both(case):
    """(h, n) of the model-dtype op and (h, q, q_scale) of its quantized form, for one case."""
    h, n = case.run()
    out = getattr(ltx_kernels, case.op + "_quant")(*case.args(), upcast=case.upcast)
    return h, n, ((None, *out) if h is None else out)


def check_norm_quant(case, what):
    h, n, (h8, q, q_scale) = _run_both(case)
    if h is not None:
        assert torch.equal(h8, h), f"{what}: h differs from {case.op}'s"
    assert_exact_e4m3(q, q_scale, n, what)


@pytest.mark.parametrize("precision", ["model", "upcast_fp32"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_quant(device, op, dtype, shape, precision):
    _skip_big_on_cpu(device, shape)
    case = make_case(op, shape, dtype, device, precision, "D")
    check_norm_quant(case, case.describe())


@pytest.mark.parametrize("broadcast", BROADCASTS)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_quant_broadcast_forms(device, op, broadcast):
    case = make_case(op, (2, 12, 264), torch.bfloat16, device, "model", broadcast)
    check_norm_quant(case, case.describe())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_quant_strided_rows(device, op, layout):
    case = make_case(op, (3, 5, 2048), torch.bfloat16, device, "model", "BSD", layout)
    check_norm_quant(case, case.describe())


@pytest.mark.parametrize("drop", [("scale", "shift"), ("weight", "bias", "gate")], ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_quant_none_operands(device, op, drop):
    case = make_case(op, (2, 7, 264), torch.bfloat16, device, "model", "B1D", drop=drop)
    check_norm_quant(case, case.describe())


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)], ids=str)
@pytest.mark.parametrize("op", [*(o + "_quant" for o in NORM_OPS), "quantize"])
def test_empty(device, op, shape):
    if op == "quantize":
        out = ltx_kernels.quantize(torch.randn(shape, device=device))
        q, q_scale = out
    else:
        case = make_case(op[: -len("_quant")], shape, torch.bfloat16, device, "model", "D")
        out = getattr(ltx_kernels, op)(*case.args())
        q, q_scale = out[-2:]
    assert q.shape == shape and q.dtype == torch.float8_e4m3fn
    assert q_scale.shape == shape[:-1]
    if shape[-1] == 0 and q_scale.numel():  # rows with nothing in them: amax 0
        assert (q_scale == ZERO_ROW_SCALE).all()


# ------------------------------------------------------------------------------------------------
# Custom-op contract: opcheck, compile, CUDA graphs, no backward, errors
# ------------------------------------------------------------------------------------------------
def _quant_args(op, device, seq=9):
    if op == "quantize":
        return (torch.randn(2, seq, 96, device=device).to(torch.bfloat16), "gelu", "tanh")
    if op == "qk_rmsnorm_rope_quant":  # (its own tests: test_attention_quant.py)
        q = torch.randn(2, seq, 3, 32, device=device).to(torch.bfloat16)
        return (q, q, None, None, None, None)
    return make_case(
        op[: -len("_quant")], (2, seq, 96), torch.bfloat16, device, "model", "B1D"
    ).args()


@pytest.mark.parametrize("op", ltx_kernels.QUANT_OPS)
def test_opcheck(device, op):
    torch.library.opcheck(getattr(torch.ops.ltx_kernels, op), _quant_args(op, device))


@pytest.mark.parametrize("op", ["add_rmsnorm_modulate_quant", "quantize"])
def test_compiles_once(device, op):
    assert_compiles_once(getattr(ltx_kernels, op), lambda seq: _quant_args(op, device, seq))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ltx_kernels.QUANT_OPS)
def test_cuda_graph_capture(op):
    args = _quant_args(op, "cuda")
    assert_graph_replays_outputs(lambda: getattr(ltx_kernels, op)(*args))


@pytest.mark.parametrize("op", ltx_kernels.QUANT_OPS)
def test_backward_raises_naming_the_op(device, op):
    args = [
        a.detach().requires_grad_() if torch.is_tensor(a) else a for a in _quant_args(op, device)
    ]
    out = getattr(ltx_kernels, op)(*args)
    with pytest.raises(RuntimeError, match=f"ltx_kernels.{op} has no backward"):
        out[-1].sum().backward()


def test_errors(device):
    x = torch.randn(3, 64, device=device)
    with pytest.raises(RuntimeError, match="ltx_kernels.quantize: activation must be"):
        ltx_kernels.quantize(x, "relu")
    with pytest.raises(RuntimeError, match="ltx_kernels.quantize: approximate must be"):
        ltx_kernels.quantize(x, "gelu", "gelu_tanh")
    with pytest.raises(RuntimeError, match="ltx_kernels.quantize: format must be 'e4m3_row'"):
        ltx_kernels.quantize(x, format="e4m3")
    with pytest.raises(RuntimeError, match="ltx_kernels.quantize: x must be float32"):
        ltx_kernels.quantize(x.double())
    with pytest.raises(RuntimeError, match="ltx_kernels.rmsnorm_modulate_quant: scale must have"):
        ltx_kernels.rmsnorm_modulate_quant(x, torch.randn(63, device=device), None)
