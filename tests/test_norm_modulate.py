"""The fused norm + AdaLN modulation ops (rmsnorm_modulate, layernorm_modulate,
add_rmsnorm_modulate, add_layernorm_modulate) against a float64 evaluation of the reference with
the same rounding points, on CPU and CUDA: every dtype, odd hidden sizes, 1/7/4096 rows, every
broadcast form of scale/shift/gate, None operands, upcast False/True (fp32 modulation as Wan),
strided and misaligned rows, empty tensors, 64-bit offsets, opcheck, torch.compile, CUDA graphs,
bad inputs, and parity with diffusers' own blocks (LTX-Video, FLUX AdaLN, Wan)."""

from dataclasses import dataclass

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference

from helpers import (
    BROADCASTS,
    DTYPES,
    FRAMES,
    LAYOUTS,
    assert_compiles_once,
    assert_new_contiguous,
    assert_rounds_within,
    capture_graph,
    make_activation,
    make_modulation,
    poison_allocator,
    rows_hidden_cases,
    skip_big_on_cpu,
    varied_rows,
)

OPS = ["rmsnorm_modulate", "layernorm_modulate", "add_rmsnorm_modulate", "add_layernorm_modulate"]
# model: upcast=False, every operand in x's dtype (LTX-Video, FLUX). upcast: upcast=True with
# operands in x's dtype. upcast_fp32: upcast=True with fp32 modulation, weight and bias (Wan).
PRECISIONS = ["model", "upcast", "upcast_fp32"]
OPTIONAL = ["scale", "shift", "gate", "weight", "bias"]


@dataclass
class NormCase:
    """The operands of one call of a fused norm op; None operands are skipped by the op."""

    op: str
    x: torch.Tensor
    y: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 1e-6
    upcast: bool = False

    @property
    def residual(self) -> bool:
        return self.op.startswith("add_")

    @property
    def kind(self) -> str:
        return "rms" if "rmsnorm" in self.op else "layer"

    def args(self) -> tuple:
        """Positional arguments in the op's order."""
        args = (self.x,) + ((self.y,) if self.residual else ()) + (self.scale, self.shift)
        args += ((self.gate,) if self.residual else ()) + (self.weight,)
        args += ((self.bias,) if self.kind == "layer" else ()) + (self.eps,)
        return args

    def tensors(self) -> list:
        return [self.x, self.y, self.scale, self.shift, self.gate, self.weight, self.bias]

    def run(self):
        """(h, n) from ltx_kernels; h is None for the ops without a residual."""
        out = getattr(ltx_kernels, self.op)(*self.args(), upcast=self.upcast)
        return out if self.residual else (None, out)

    def describe(self) -> str:
        def d(t):
            return "None" if t is None else f"{tuple(t.shape)}/{str(t.dtype)[6:]}"

        return (
            f"{self.op} x {d(self.x)} scale {d(self.scale)} shift {d(self.shift)} "
            f"gate {d(self.gate) if self.residual else '-'} weight {d(self.weight)} "
            f"bias {d(self.bias) if self.kind == 'layer' else '-'} upcast={self.upcast}"
        )


def make_case(
    op,
    shape,
    dtype,
    device,
    precision="model",
    broadcast="D",
    layout="contiguous",
    drop=(),
    eps=1e-6,
) -> NormCase:
    """Random operands for `op` on x of `shape` = [B, S, D] (or [rows, D] with broadcast "D"):
    modulation of the broadcast form `broadcast`, operands named in `drop` set to None."""
    hidden = shape[-1]
    upcast = precision != "model"
    param_dtype = torch.float32 if precision == "upcast_fp32" else dtype
    x = varied_rows(shape, dtype, device, layout)
    y = make_activation(shape, dtype, device, layout) if op.startswith("add_") else None
    batch, seq = (shape[0], shape[1]) if len(shape) == 3 else (1, 1)
    shift, scale, gate = make_modulation(broadcast, batch, seq, hidden, param_dtype, device, 3)
    if broadcast == "frames":
        x = x.unflatten(1, (FRAMES, -1))
        y = None if y is None else y.unflatten(1, (FRAMES, -1))
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(param_dtype)
    bias = (0.5 * torch.randn(hidden, device=device)).to(param_dtype)
    case = NormCase(op, x, y, scale, shift, gate, weight, bias, eps, upcast)
    for name in drop:
        setattr(case, name, None)
    return case


def norm_bounds(case: NormCase, h: torch.Tensor):
    """(roundings, magnitude, slop_magnitude, intermediate_scale) of n = norm(h) modulated, for
    assert_rounds_within. Intermediates: y_ = normalized h, n0 = y_ * w (+ b), n0 * (1 + scale);
    fp32 error: relative to y_ for RMS, to (|h| + |mean|) / std for LayerNorm (the mean is
    subtracted in fp32)."""
    hc = h.double()
    if case.kind == "rms":
        rstd = torch.rsqrt(hc.pow(2).mean(-1, keepdim=True) + case.eps)
        normalized = hc * rstd
        normalized_slop = normalized.abs()
    else:
        centered = hc - hc.mean(-1, keepdim=True)
        rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + case.eps)
        normalized = centered * rstd
        normalized_slop = normalized.abs() + hc.abs().mean(-1, keepdim=True) * rstd
    w = case.weight.double().abs() if case.weight is not None else torch.ones_like(hc[..., :1])
    b = case.bias.double().abs() if case.kind == "layer" and case.bias is not None else 0.0
    s = (1 + case.scale.double()).abs() if case.scale is not None else 1.0
    sh = case.shift.double().abs() if case.shift is not None else 0.0
    magnitude = (normalized.abs() * w + b) * s
    slop = (normalized_slop * w + b) * s + sh
    if case.upcast:
        roundings = 0  # one rounding, at the end
    else:
        # R points: R(y_) [and R(y_ * w) for RMS with a weight, folded in one for LayerNorm],
        # R(1 + scale) and R(n * (1 + scale)). (Without a shift the last one is the output
        # rounding, but the reference has applied it already, so it counts like the others.)
        roundings = 1 + (case.kind == "rms" and case.weight is not None)
        roundings += 2 * (case.scale is not None)
    later = float(w.max()) * (float(torch.as_tensor(s).max()) if case.scale is not None else 1.0)
    return roundings, magnitude, slop, later


def exact_n(case: NormCase, h: torch.Tensor) -> torch.Tensor:
    """float64 n of the op from its (rounded) normalized input h: the single-input op's
    reference, as the add_* references compute n from h."""
    base = reference.rmsnorm_modulate if case.kind == "rms" else reference.layernorm_modulate
    params = (case.weight,) + ((case.bias,) if case.kind == "layer" else ())
    return base(
        h,
        case.scale,
        case.shift,
        *params,
        case.eps,
        upcast=case.upcast,
        compute_dtype=torch.float64,
        round_output=False,
    )


def check_h(case: NormCase, h: torch.Tensor, what: str) -> None:
    """h = round_T(x + R(y * gate)) (x + y without gate)."""
    exact = getattr(reference, case.op)(
        *case.args(), upcast=case.upcast, compute_dtype=torch.float64, round_output=False
    )[0]
    product = case.y.double().abs() * (case.gate.double().abs() if case.gate is not None else 1)
    gated_in_model_dtype = case.gate is not None and not case.upcast
    assert_rounds_within(
        h,
        exact,
        f"{what}: h",
        roundings=int(gated_in_model_dtype),
        magnitude=product,
        slop_magnitude=case.x.double().abs() + product,
    )


def check_n(case: NormCase, n: torch.Tensor, h: torch.Tensor, what: str) -> None:
    """n against the float64 reference evaluated from the op's own h (a one-ulp flip of h is
    judged by check_h; here it would only blur the bound)."""
    roundings, magnitude, slop, later = norm_bounds(case, h)
    assert_rounds_within(
        n,
        exact_n(case, h),
        f"{what}: n",
        roundings=roundings,
        magnitude=magnitude,
        slop_magnitude=slop,
        intermediate_scale=later,
    )


def run_and_check(case: NormCase, what: str = ""):
    what = f"{what} {case.describe()}".strip()
    x = case.x
    for _ in range(1 + case.residual):  # NaN-filled memory for every output
        poison_allocator(x.device.type, x.numel() * x.element_size())
    h, n = case.run()
    outputs = [n] if h is None else [h, n]
    assert_new_contiguous(outputs, case.tensors(), x.dtype, x.shape, what)
    if h is not None:
        check_h(case, h, what)
    check_n(case, n, h if h is not None else x, what)
    return h, n


# ------------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("rows,hidden", rows_hidden_cases())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(device, op, dtype, rows, hidden, precision):
    skip_big_on_cpu(device, rows, hidden, keep=precision != "upcast")
    run_and_check(make_case(op, (rows, hidden), dtype, device, precision))


@pytest.mark.parametrize("hidden", [111, 264])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("broadcast", BROADCASTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_broadcast_forms(device, op, dtype, broadcast, precision, hidden):
    # scale, shift (and gate) as [D], [B,1,D], per token, strided views of a [B,1,6,D] / [B,6D] /
    # [B,S,6,D] modulation tensor, and per frame against x viewed as [B,F,S/F,D].
    run_and_check(make_case(op, (2, 12, hidden), dtype, device, precision, broadcast))


@pytest.mark.gpu
@pytest.mark.parametrize("broadcast", ["D", "BSD", "unbind6", "token_unbind6", "frames"])
@pytest.mark.parametrize("op", OPS)
def test_broadcast_forms_many_rows(op, broadcast):
    # Multi-wave grids (per-channel vectors staged in shared memory) with every broadcast form.
    for precision in ("model", "upcast_fp32"):
        run_and_check(make_case(op, (2, 2049, 2048), torch.bfloat16, "cuda", precision, broadcast))


@pytest.mark.parametrize("hidden", [111, 2048])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_strided_rows(device, op, dtype, layout, hidden):
    # x (and y) with padded or misaligned rows, modulation from a [B,1,6,D] table.
    for precision in ("model", "upcast_fp32"):
        run_and_check(make_case(op, (3, 5, hidden), dtype, device, precision, "unbind6", layout))


def test_rows_of_a_fused_projection(device):
    # x and y as chunks of wider projections (rows 3D apart), modulation per token.
    base = torch.randn(2, 9, 3 * 256, device=device).to(torch.bfloat16)
    x, _, y = base.chunk(3, dim=-1)
    shift, scale, gate = make_modulation("token_unbind6", 2, 9, 256, torch.bfloat16, device, 3)
    run_and_check(NormCase("add_layernorm_modulate", x, y, scale, shift, gate))
    run_and_check(
        NormCase("rmsnorm_modulate", base[:, ::2, 256:512], None, scale[:, ::2], shift[:, ::2])
    )


@pytest.mark.parametrize(
    "drop",
    [*[(name,) for name in OPTIONAL], tuple(OPTIONAL)],
    ids=lambda d: "all" if len(d) > 1 else d[0],
)
@pytest.mark.parametrize("precision", ["model", "upcast_fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_none_operands(device, op, dtype, precision, drop):
    case = make_case(op, (2, 6, 200), dtype, device, precision, "B1D", drop=drop)
    run_and_check(case)


@pytest.mark.parametrize("op", OPS)
def test_upcast_operand_dtypes(device, op):
    # upcast=True: modulation in x's dtype or fp32 (one dtype), weight and bias each either.
    bf16, fp32 = torch.bfloat16, torch.float32
    for mod_dtype in (bf16, fp32):
        for weight_dtype in (bf16, fp32):
            for bias_dtype in (bf16, fp32):
                case = make_case(op, (2, 4, 320), bf16, device, "upcast", "unbind6")
                case.scale, case.shift = case.scale.to(mod_dtype), case.shift.to(mod_dtype)
                case.gate = case.gate.to(mod_dtype)
                case.weight, case.bias = case.weight.to(weight_dtype), case.bias.to(bias_dtype)
                run_and_check(case)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.1])
@pytest.mark.parametrize("op", OPS)
def test_eps_is_used(device, op, eps):
    case = make_case(op, (4, 256), torch.float32, device, "model", eps=eps)
    case.x.mul_(1e-2)
    if case.y is not None:
        case.y.mul_(1e-2)
    run_and_check(case)


@pytest.mark.parametrize("op", ["layernorm_modulate", "add_layernorm_modulate"])
def test_layernorm_of_rows_with_a_large_mean(device, op):
    # fp32 rows with mean 256 and std ~1: a variance computed as E[h^2] - E[h]^2 in fp32 is off
    # by several percent; the mean must be subtracted before squaring (or Welford).
    case = make_case(op, (8, 1024), torch.float32, device, "model")
    case.x = 256 + torch.randn(8, 1024, device=device)
    if case.y is not None:
        case.y.mul_(0.5)
    run_and_check(case)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)])
@pytest.mark.parametrize("op", OPS)
def test_empty(device, op, shape):
    case = make_case(op, shape, torch.bfloat16, device, "model", "D")
    h, n = case.run()
    assert_new_contiguous([n] if h is None else [h, n], [], torch.bfloat16, shape, op)


def test_64bit_offsets(device):
    # Row 1 of x and y starts 2^31 elements into the buffer: 32-bit offsets would wrap. Only the
    # rows are touched, so the 4 GiB buffer costs nothing on the CPU.
    hidden = 2048
    try:
        buf = torch.empty(2**31 + 2 * hidden, dtype=torch.bfloat16, device=device)
    except (RuntimeError, MemoryError):  # pragma: no cover - depends on the machine
        pytest.skip("cannot allocate a 4 GiB buffer")
    x = buf.as_strided((2, hidden), (2**31, 1))
    y = buf.as_strided((2, hidden), (2**31, 1), hidden)
    x.copy_(torch.randn(2, hidden, device=device))
    y.copy_(torch.randn(2, hidden, device=device))
    scale, shift, gate = (0.5 * torch.randn(3, 2, hidden, device=device)).to(torch.bfloat16)
    run_and_check(NormCase("add_rmsnorm_modulate", x, y, scale, shift, gate))
    del buf, x, y


# ------------------------------------------------------------------------------------------------
# The rounding check itself: it must reject an op whose rounding points differ from the reference.
# ------------------------------------------------------------------------------------------------
def _fp32_rmsnorm_modulate(x, scale, shift, weight, eps, round_y, round_product, round_one_plus):
    """rmsnorm_modulate in fp32 with each intermediate rounding optional (a wrong kernel)."""

    def r(v, on):
        return v.to(x.dtype).float() if on else v

    h = x.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    n = r(r(y, round_y) * weight.float(), True)
    n = r(n * r(1 + scale.float(), round_one_plus), round_product)
    return (n + shift.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rounding_check_rejects_wrong_rounding_points(dtype):
    case = make_case("rmsnorm_modulate", (64, 1024), dtype, "cpu", "model")
    args = (case.x, case.scale, case.shift, case.weight, case.eps)
    right = _fp32_rmsnorm_modulate(*args, True, True, True)
    check_n(case, right, case.x, "all rounding points")  # the emulation itself passes
    for dropped in range(3):
        flags = [True, True, True]
        flags[dropped] = False
        with pytest.raises(AssertionError, match="correctly rounded"):
            check_n(case, _fp32_rmsnorm_modulate(*args, *flags), case.x, f"drop {dropped}")
    with pytest.raises(AssertionError):  # one rounding only (upcast semantics)
        check_n(case, reference.rmsnorm_modulate(*args, upcast=True), case.x, "upcast")


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def _raises(case: NormCase, pattern: str):
    with pytest.raises(RuntimeError, match=f"ltx_kernels.{case.op}: {pattern}"):
        case.run()


def _case(op, device, **changes):
    case = make_case(op, (2, 6, 64), torch.bfloat16, device, "model", "B1D")
    for name, value in changes.items():
        setattr(case, name, value)
    return case


@pytest.mark.parametrize("op", OPS)
def test_errors_name_the_argument(device, op):
    c = _case(op, device)
    x, scale = c.x, c.scale
    if device == "cpu":  # float64 runs the C twin in double (gradcheck: test_gradcheck.py)
        names = ("x", "y", "scale", "shift", "gate", "weight", "bias")
        double = {n: getattr(c, n).double() for n in names if getattr(c, n) is not None}
        assert _case(op, device, **double).run()[1].dtype == torch.float64
        _raises(
            _case(op, device, x=x.double(), y=None if c.y is None else c.y.double()),
            "scale must have x's dtype float64",
        )
    else:
        _raises(_case(op, device, x=x.double()), "x is float64, which only the CPU backend takes")
    _raises(
        _case(op, device, x=x.int()),
        r"x must be float32, float16, bfloat16 or \(CPU\) float64, got int32",
    )
    _raises(
        _case(op, device, x=x.transpose(1, 2).contiguous().transpose(1, 2)),
        "x must have a contiguous last dimension",
    )
    _raises(
        _case(
            op,
            device,
            x=x[0, 0, 0],
            scale=None,
            shift=None,
            gate=None,
            weight=None,
            bias=None,
            y=None if c.y is None else c.y[0, 0, 0],
        ),
        "x must have at least 1 dimension",
    )
    _raises(
        _case(op, device, scale=scale.double()),
        "scale must be float32, float16 or bfloat16, got float64",
    )
    _raises(
        _case(
            op, device, shift=torch.zeros(2, 1, 64, 2, device=device, dtype=torch.bfloat16)[..., 0]
        ),
        "shift must have a contiguous last dimension",
    )
    _raises(
        _case(op, device, scale=scale[0, 0, 0]),
        r"scale must have last dimension 64, got shape \[\]",
    )  # a 0-d scale
    _raises(_case(op, device, scale=scale[..., :32]), "scale must have last dimension 64")
    _raises(
        _case(op, device, shift=torch.zeros(3, 1, 64, device=device, dtype=torch.bfloat16)),
        r"shift with shape \[3, 1, 64\] does not broadcast to x's shape",
    )
    _raises(
        _case(op, device, scale=torch.zeros(2, 6, 1, 64, device=device, dtype=torch.bfloat16)),
        r"scale with shape \[2, 6, 1, 64\] does not broadcast to x's shape",
    )
    _raises(
        _case(op, device, weight=torch.ones(32, device=device, dtype=torch.bfloat16)),
        r"weight must have shape \[hidden\] = \[64\]",
    )
    _raises(
        _case(op, device, weight=torch.ones(1, 64, device=device, dtype=torch.bfloat16)),
        r"weight must have shape \[hidden\] = \[64\]",
    )
    _raises(_case(op, device, eps=-1.0), "eps must be finite and >= 0")
    # upcast=False: every operand in x's dtype.
    _raises(_case(op, device, scale=scale.float()), "scale must have x's dtype")
    _raises(_case(op, device, weight=c.weight.float()), "weight must have x's dtype")
    if c.kind == "layer":
        _raises(
            _case(op, device, bias=torch.ones(63, device=device, dtype=torch.bfloat16)),
            r"bias must have shape \[hidden\] = \[64\]",
        )
        _raises(_case(op, device, bias=c.bias.float()), "bias must have x's dtype")
    if c.residual:
        _raises(_case(op, device, y=c.y[:, :5]), "y must have x's shape")
        _raises(_case(op, device, y=c.y[:1]), "y must have x's shape")  # no broadcasting of y
        _raises(_case(op, device, y=c.y.half()), "y must have x's dtype")
        _raises(_case(op, device, gate=c.gate.float()), "gate must have x's dtype")
        _raises(_case(op, device, gate=c.gate[..., :32]), "gate must have last dimension 64")
        _raises(
            _case(op, device, gate=torch.zeros(2, 5, 64, device=device, dtype=torch.bfloat16)),
            r"gate with shape \[2, 5, 64\] does not broadcast to x's shape",
        )


@pytest.mark.parametrize("op", OPS)
def test_upcast_dtype_errors(device, op):
    # upcast=True: modulation tensors share one dtype, x's or fp32; weight/bias x's dtype or fp32.
    c = _case(op, device, upcast=True)
    _raises(
        _case(op, device, upcast=True, scale=c.scale.half()),
        "scale must be bfloat16 or float32",
    )
    _raises(
        _case(op, device, upcast=True, weight=c.weight.half()),
        "weight must be bfloat16 or float32",
    )
    _raises(
        _case(op, device, upcast=True, scale=c.scale.float()), "shift must have the dtype of scale"
    )
    if c.residual:
        _raises(
            _case(op, device, upcast=True, gate=c.gate.float()), "gate must have the dtype of scale"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_device_mismatch_raises(op):
    c = _case(op, "cuda")
    for name in ("scale", "shift", "weight") + (("gate", "y") if c.residual else ()):
        _raises(
            _case(op, "cuda", **{name: getattr(c, name).cpu()}),
            f"{name} is on cpu but x is on cuda:0",
        )


# ------------------------------------------------------------------------------------------------
# torch.library, torch.compile, CUDA graphs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case_kind", ["bf16_model", "bf16_upcast_fp32", "fp32_model"])
@pytest.mark.parametrize("op", OPS)
def test_opcheck(device, op, case_kind):
    dtype = torch.float32 if case_kind.startswith("fp32") else torch.bfloat16
    precision = "upcast_fp32" if "upcast" in case_kind else "model"
    case = make_case(op, (2, 6, 96), dtype, device, precision, "unbind6", "row_strided")
    overload = getattr(torch.ops.ltx_kernels, op).default
    torch.library.opcheck(overload, case.args(), {"upcast": case.upcast})
    bare = make_case(
        op,
        (2, 6, 96),
        dtype,
        device,
        precision,
        "D",
        drop=("scale", "shift", "gate", "weight", "bias"),
    )
    torch.library.opcheck(overload, bare.args(), {"upcast": bare.upcast})


def _block(x, y, modulation, weight, bias):
    """A DiT block's norm steps: modulation rows come from unbinding a [B,1,6,D] tensor inside
    the graph; every fused norm op runs once."""
    shift, scale, gate, shift2, scale2, _ = modulation.unbind(2)
    n1 = ltx_kernels.rmsnorm_modulate(x, scale, shift, weight)
    h, n2 = ltx_kernels.add_rmsnorm_modulate(x, n1, scale2, shift2, gate)
    n3 = ltx_kernels.layernorm_modulate(h, scale, shift, weight, bias)
    h2, n4 = ltx_kernels.add_layernorm_modulate(h, y, scale2, shift2, gate, None, bias)
    return n2 * 2 + 1, n3, h2, n4


def test_compile_fullgraph_no_recompile(device):
    bf16 = torch.bfloat16
    weight = (1 + 0.5 * torch.randn(128, device=device)).to(bf16)
    bias = torch.randn(128, device=device).to(bf16)
    modulation = (0.5 * torch.randn(2, 1, 6, 128, device=device)).to(bf16)
    assert_compiles_once(
        _block,
        lambda seq: (
            torch.randn(2, seq, 128, device=device).to(bf16),
            torch.randn(2, seq, 128, device=device).to(bf16),
            modulation,
            weight,
            bias,
        ),
    )


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    cases = [
        make_case(op, (2, 64, 2048), torch.bfloat16, "cuda", precision, "unbind6")
        for op in OPS
        for precision in ("model", "upcast_fp32")
    ]
    graph, results = capture_graph(lambda: [case.run() for case in cases])
    for _ in range(2):  # new data in the captured inputs, then replay
        for case in cases:
            case.x.copy_(torch.randn_like(case.x, dtype=torch.float32))
            if case.y is not None:
                case.y.copy_(torch.randn_like(case.y, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        for case, (h, n) in zip(cases, results):
            if h is not None:
                check_h(case, h, "graph replay")
            check_n(case, n, h if h is not None else case.x, "graph replay")


# ------------------------------------------------------------------------------------------------
# Parity with diffusers' blocks
# ------------------------------------------------------------------------------------------------
def _assert_matches_model(out, expected, what):
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    match = (out == expected).float().mean().item()
    assert match > 0.99, f"{what}: only {match:.4f} of the elements equal diffusers' output"


def test_matches_diffusers_ltx_block(device):
    # LTXVideoTransformerBlock in bf16: RMSNorm(elementwise_affine=False), per-token ada values
    # from `scale_shift_table[None, None] + temb.reshape(B, T, 6, -1)` unbound along dim 2.
    normalization = pytest.importorskip("diffusers.models.normalization")
    dim, bf16 = 2048, torch.bfloat16
    norm1 = normalization.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
    norm2 = normalization.RMSNorm(dim, eps=1e-6, elementwise_affine=False)
    table = (torch.randn(6, dim, device=device) / dim**0.5).to(bf16)
    temb = (0.3 * torch.randn(2, 1, 6 * dim, device=device)).to(bf16)
    hidden = torch.randn(2, 96, dim, device=device).to(bf16)
    attn = torch.randn(2, 96, dim, device=device).to(bf16)
    ada = table[None, None] + temb.reshape(2, 1, 6, -1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, _ = ada.unbind(dim=2)

    expected = norm1(hidden) * (1 + scale_msa) + shift_msa
    out = ltx_kernels.rmsnorm_modulate(hidden, scale_msa, shift_msa, None, 1e-6)
    _assert_matches_model(out, expected, "norm1 modulation")

    expected_h = hidden + attn * gate_msa
    expected_n = norm2(expected_h) * (1 + scale_mlp) + shift_mlp
    h, n = ltx_kernels.add_rmsnorm_modulate(hidden, attn, scale_mlp, shift_mlp, gate_msa)
    _assert_matches_model(h, expected_h, "gated residual")
    _assert_matches_model(n, expected_n, "norm2 modulation")


def test_matches_diffusers_adaln_zero(device):
    # FLUX / SD3 AdaLayerNormZero in bf16: LayerNorm(elementwise_affine=False, eps=1e-6) and
    # [B, 6D] modulation chunks broadcast as [:, None].
    normalization = pytest.importorskip("diffusers.models.normalization")
    dim, bf16 = 3072, torch.bfloat16
    module = normalization.AdaLayerNormZero(dim, num_embeddings=None, norm_type="layer_norm")
    module = module.to(device=device, dtype=bf16)
    x = torch.randn(2, 77, dim, device=device).to(bf16)
    emb = torch.randn(2, dim, device=device).to(bf16)
    expected, *_ = module(x, emb=emb)
    assert isinstance(module.norm, torch.nn.LayerNorm) and module.norm.weight is None
    shift, scale, *_ = module.linear(module.silu(emb)).chunk(6, dim=1)
    out = ltx_kernels.layernorm_modulate(
        x, scale[:, None], shift[:, None], None, None, module.norm.eps
    )
    _assert_matches_model(out, expected, "AdaLayerNormZero")


def test_matches_diffusers_wan_block(device):
    # WanTransformerBlock: fp32 scale_shift_table + temb chunks (fp32 [B,1,D] views), FP32LayerNorm
    # without affine on x.float(), `.type_as(x)`; then the fp32-gated residual and norm3.
    normalization = pytest.importorskip("diffusers.models.normalization")
    dim, bf16 = 1536, torch.bfloat16
    norm = normalization.FP32LayerNorm(dim, 1e-6, elementwise_affine=False)
    table = torch.randn(1, 6, dim, device=device) / dim**0.5
    temb = (0.3 * torch.randn(2, 6, dim, device=device)).to(bf16)
    shift, scale, gate, c_shift, c_scale, _ = (table + temb.float()).chunk(6, dim=1)
    hidden = torch.randn(2, 120, dim, device=device).to(bf16)
    attn = torch.randn(2, 120, dim, device=device).to(bf16)

    expected = (norm(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    out = ltx_kernels.layernorm_modulate(hidden, scale, shift, None, None, 1e-6, upcast=True)
    _assert_matches_model(out, expected, "norm1 modulation")

    expected_h = (hidden.float() + attn * gate).type_as(hidden)
    expected_n = (norm(expected_h.float()) * (1 + c_scale) + c_shift).type_as(hidden)
    h, n = ltx_kernels.add_layernorm_modulate(
        hidden, attn, c_scale, c_shift, gate, None, None, 1e-6, upcast=True
    )
    _assert_matches_model(h, expected_h, "gated residual")
    _assert_matches_model(n, expected_n, "norm3 modulation")

    # norm2 (cross_attn_norm=True): FP32LayerNorm with an affine fp32 weight and bias, no
    # modulation.
    affine = normalization.FP32LayerNorm(dim, 1e-6, elementwise_affine=True).to(device)
    with torch.no_grad():
        affine.weight.copy_(1 + 0.3 * torch.randn(dim))
        affine.bias.copy_(0.3 * torch.randn(dim))
    expected = affine(hidden.float()).type_as(hidden)
    out = ltx_kernels.layernorm_modulate(
        hidden, None, None, affine.weight, affine.bias, 1e-6, upcast=True
    )
    _assert_matches_model(out, expected, "norm2")
