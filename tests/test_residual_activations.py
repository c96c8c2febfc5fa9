"""gated_residual, gelu, geglu and linear_gelu against float64 evaluations of the references with
the same rounding points, on CPU and CUDA: every dtype, odd hidden sizes, 1/7/4096 rows, every
broadcast form of the gate, upcast False/True (fp32 gate as Wan), strided and misaligned rows,
empty tensors, opcheck, torch.compile, CUDA graphs, bad inputs, and parity with diffusers' GELU /
GEGLU modules and the residual expressions of the LTX-Video and Wan blocks."""

import pytest
import torch
import torch.nn.functional as F

import ltx_kernels
from ltx_kernels import reference

from helpers import (
    BROADCASTS,
    DTYPES,
    FRAMES,
    LAYOUTS,
    MANTISSA_BITS,
    assert_compiles_once,
    assert_new_contiguous,
    assert_rounds_within,
    capture_graph,
    gelu_range,
    make_activation,
    make_modulation,
    poison_allocator,
    rows_hidden_cases,
    skip_big_on_cpu,
    varied_rows,
)

PRECISIONS = ["model", "upcast", "upcast_fp32"]  # as in test_norm_modulate.py
APPROXIMATE = ["none", "tanh"]


# ------------------------------------------------------------------------------------------------
# gated_residual: out = round_T(x + R(y * gate)), or round_T(x + y)
# ------------------------------------------------------------------------------------------------
def check_gated_residual(x, y, gate, upcast, what=""):
    what = (
        f"{what} gated_residual x {tuple(x.shape)}/{x.dtype} gate "
        f"{None if gate is None else (tuple(gate.shape), gate.dtype)} upcast={upcast}"
    )
    poison_allocator(x.device.type, x.numel() * x.element_size())
    out = ltx_kernels.gated_residual(x, y, gate, upcast=upcast)
    assert_new_contiguous([out], [x, y, gate], x.dtype, x.shape, what)
    exact = reference.gated_residual(
        x, y, gate, upcast=upcast, compute_dtype=torch.float64, round_output=False
    )
    product = y.double().abs() * (gate.double().abs() if gate is not None else 1)
    assert_rounds_within(
        out,
        exact,
        what,
        roundings=int(gate is not None and not upcast),
        magnitude=product,
        slop_magnitude=x.double().abs() + product,
    )
    return out


def make_residual(shape, dtype, device, precision, broadcast="D", layout="contiguous"):
    """x, y of `shape` in `layout`, a gate of the broadcast form, and upcast."""
    gate_dtype = torch.float32 if precision == "upcast_fp32" else dtype
    x = varied_rows(shape, dtype, device, layout)
    y = make_activation(shape, dtype, device, layout)
    batch, seq = (shape[0], shape[1]) if len(shape) == 3 else (1, 1)
    (gate,) = make_modulation(broadcast, batch, seq, shape[-1], gate_dtype, device, 1, std=1.0)
    if broadcast == "frames":
        x, y = x.unflatten(1, (FRAMES, -1)), y.unflatten(1, (FRAMES, -1))
    return x, y, gate, precision != "model"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("rows,hidden", rows_hidden_cases())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_matches_reference(device, dtype, rows, hidden, precision):
    skip_big_on_cpu(device, rows, hidden, keep=precision != "upcast")
    check_gated_residual(*make_residual((rows, hidden), dtype, device, precision))


@pytest.mark.parametrize("hidden", [111, 264])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("broadcast", BROADCASTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_broadcast_forms(device, dtype, broadcast, precision, hidden):
    check_gated_residual(*make_residual((2, 12, hidden), dtype, device, precision, broadcast))


@pytest.mark.parametrize("hidden", [111, 2048])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_strided_rows(device, dtype, layout, hidden):
    for precision in ("model", "upcast_fp32"):
        check_gated_residual(
            *make_residual((3, 5, hidden), dtype, device, precision, "unbind6", layout)
        )


@pytest.mark.parametrize("precision", ["model", "upcast"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_without_gate(device, dtype, precision):
    x, y, _, upcast = make_residual((2, 9, 769), dtype, device, precision)
    check_gated_residual(x, y, None, upcast)
    check_gated_residual(x[:, 1:], y[:, :-1], None, upcast)  # rows of x and y at other offsets


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)])
def test_gated_residual_empty(device, shape):
    x = torch.randn(shape, device=device).to(torch.bfloat16)
    gate = torch.randn(shape[-1], device=device).to(torch.bfloat16)
    for g in (gate, None):
        out = ltx_kernels.gated_residual(x, x.clone(), g)
        assert_new_contiguous([out], [], torch.bfloat16, shape, "empty")


def test_gated_residual_errors(device):
    bf16 = torch.bfloat16
    x = torch.randn(2, 6, 64, device=device).to(bf16)
    gate = torch.randn(2, 1, 64, device=device).to(bf16)
    op = ltx_kernels.gated_residual

    def raises(pattern, *args, **kwargs):
        with pytest.raises(RuntimeError, match=f"ltx_kernels.gated_residual: {pattern}"):
            op(*args, **kwargs)

    if device == "cpu":  # float64 runs the C twin in double (gradcheck: test_gradcheck.py)
        assert op(x.double(), x.double(), gate.double()).dtype == torch.float64
        raises("gate must have x's dtype float64", x.double(), x.double(), gate)
    else:
        raises("x is float64, which only the CPU backend takes", x.double(), x.double(), None)
    raises(r"x must be float32, float16, bfloat16 or \(CPU\) float64, got int32", x.int(), x.int())
    raises("x must have a contiguous last dimension", x.transpose(0, 2), x.transpose(0, 2), None)
    raises("x must have at least 1 dimension", x[0, 0, 0], x[0, 0, 0], None)
    raises("y must have x's shape", x, x[:, :5], gate)
    raises("y must have x's shape", x, x[:1], gate)  # y never broadcasts
    raises("y must have x's dtype", x, x.half(), gate)
    raises("gate must be float32, float16 or bfloat16, got float64", x, x, gate.double())
    raises(
        "gate must have a contiguous last dimension",
        x,
        x,
        torch.zeros(2, 1, 64, 2, device=device, dtype=bf16)[..., 0],
    )
    raises("gate must have last dimension 64", x, x, gate[..., :32])
    raises(
        r"gate with shape \[2, 5, 64\] does not broadcast to x's shape",
        x,
        x,
        torch.zeros(2, 5, 64, device=device, dtype=bf16),
    )
    raises("gate must have x's dtype", x, x, gate.float())  # upcast=False
    raises("gate must be bfloat16 or float32", x, x, gate.half(), upcast=True)


@pytest.mark.gpu
def test_gated_residual_device_mismatch():
    x = torch.randn(2, 6, 64, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="gate is on cpu but x is on cuda:0"):
        ltx_kernels.gated_residual(x, x, x[:, :1].cpu())
    with pytest.raises(RuntimeError, match="y is on cpu but x is on cuda:0"):
        ltx_kernels.gated_residual(x, x.cpu(), None)


def test_gated_residual_matches_ltx_and_wan_blocks(device):
    # LTXVideoTransformerBlock (bf16): `hidden_states + attn_hidden_states * gate_msa` with the
    # gate an unbound view of `scale_shift_table[None, None] + temb.reshape(B, 1, 6, -1)`.
    bf16 = torch.bfloat16
    hidden = torch.randn(2, 64, 2048, device=device).to(bf16)
    attn = torch.randn(2, 64, 2048, device=device).to(bf16)
    ada = (torch.randn(6, 2048, device=device) / 45)[None, None].to(bf16) + (
        0.3 * torch.randn(2, 1, 6, 2048, device=device)
    ).to(bf16)
    gate = ada.unbind(dim=2)[2]
    expected = hidden + attn * gate
    out = ltx_kernels.gated_residual(hidden, attn, gate)
    assert (out == expected).float().mean() > 0.99, "differs from the LTX-Video block"
    # ... and `hidden_states + attn_hidden_states` after the cross-attention.
    assert torch.equal(ltx_kernels.gated_residual(hidden, attn), hidden + attn)
    # WanTransformerBlock: `(hidden_states.float() + attn_output * gate_msa).type_as(...)` with
    # the gate an fp32 [B, 1, D] chunk of `scale_shift_table + temb.float()`.
    table = torch.randn(1, 6, 2048, device=device) / 45
    gate32 = (table + (0.3 * torch.randn(2, 6, 2048, device=device)).to(bf16).float()).chunk(
        6, dim=1
    )[2]
    expected = (hidden.float() + attn * gate32).type_as(hidden)
    out = ltx_kernels.gated_residual(hidden, attn, gate32, upcast=True)
    assert (out == expected).float().mean() > 0.99, "differs from the Wan block"


# ------------------------------------------------------------------------------------------------
# gelu: out = round_T(gelu(x)); geglu: out = round_T(h * round_T(gelu(g))), h, g = x.chunk(2, -1)
# ------------------------------------------------------------------------------------------------
def check_gelu(x, approximate, what=""):
    what = f"{what} gelu({approximate}) x {tuple(x.shape)}/{x.dtype}"
    poison_allocator(x.device.type, x.numel() * x.element_size())
    out = ltx_kernels.gelu(x, approximate)
    assert_new_contiguous([out], [x], x.dtype, x.shape, what)
    exact = reference.gelu(x, approximate, compute_dtype=torch.float64, round_output=False)
    # fp32 error: 1 + erf(..) (or 1 + tanh(..)) cancels for x << 0, an absolute error of
    # ~2^-24 in Phi(x), times |x|.
    assert_rounds_within(out, exact, what, slop_magnitude=x.double().abs())
    return out


def check_geglu(x, approximate, what=""):
    what = f"{what} geglu({approximate}) x {tuple(x.shape)}/{x.dtype}"
    out_shape = (*x.shape[:-1], x.shape[-1] // 2)
    poison_allocator(x.device.type, x.numel() * x.element_size() // 2)
    out = ltx_kernels.geglu(x, approximate)
    assert_new_contiguous([out], [x], x.dtype, out_shape, what)
    exact = reference.geglu(x, approximate, compute_dtype=torch.float64, round_output=False)
    hidden, gate = (t.double() for t in x.chunk(2, dim=-1))
    magnitude = (hidden * F.gelu(gate, approximate=approximate)).abs()
    assert_rounds_within(
        out,
        exact,
        what,
        roundings=1,
        magnitude=magnitude,
        slop_magnitude=magnitude + hidden.abs() * gate.abs(),
        intermediate_scale=float(hidden.abs().max()),
    )
    return out


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("rows,hidden", rows_hidden_cases())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_matches_reference(device, dtype, rows, hidden, approximate):
    skip_big_on_cpu(device, rows, hidden, keep=approximate == "tanh")
    check_gelu(varied_rows((rows, hidden), dtype, device) * 0.5, approximate)


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("rows,hidden", rows_hidden_cases())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_geglu_matches_reference(device, dtype, rows, hidden, approximate):
    skip_big_on_cpu(device, rows, hidden, keep=approximate == "none")
    check_geglu(varied_rows((rows, 2 * hidden), dtype, device) * 0.5, approximate)


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_over_the_whole_range(device, dtype, approximate):
    x = gelu_range(dtype, device)
    check_gelu(x, approximate)
    check_geglu(
        torch.cat([torch.randn_like(x, dtype=torch.float32).to(dtype), x], dim=-1), approximate
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activations_strided_rows(device, dtype, layout):
    for hidden in (111, 2048):
        for approximate in APPROXIMATE:
            check_gelu(make_activation((3, 5, hidden), dtype, device, layout), approximate)
            check_geglu(make_activation((3, 5, 2 * hidden), dtype, device, layout), approximate)


def test_geglu_of_a_projection_chunk(device):
    # x as a row-strided chunk of a wider projection, 3-D and 4-D.
    base = torch.randn(2, 7, 3 * 512, device=device).to(torch.bfloat16)
    check_geglu(base[..., 512:1536], "none")
    check_geglu(base.unflatten(1, (7, 1))[..., :1024], "tanh")
    check_gelu(base[:, ::2, 100:611], "tanh")


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (3, 0)])
def test_activations_empty(device, shape):
    x = torch.randn(shape, device=device).to(torch.bfloat16)
    for approximate in APPROXIMATE:
        assert_new_contiguous([ltx_kernels.gelu(x, approximate)], [], x.dtype, shape, "gelu")
        out = ltx_kernels.geglu(x, approximate)
        assert_new_contiguous([out], [], x.dtype, (*shape[:-1], shape[-1] // 2), "geglu")


def test_activation_errors(device):
    x = torch.randn(4, 64, device=device).to(torch.bfloat16)
    for op in ("gelu", "geglu"):
        fn = getattr(ltx_kernels, op)

        def raises(pattern, *args):
            with pytest.raises(RuntimeError, match=f"ltx_kernels.{op}: {pattern}"):
                fn(*args)

        if device == "cpu":  # float64 runs the C twin in double (gradcheck: test_gelu_backward.py)
            assert fn(x.double()).dtype == torch.float64
        else:
            raises("x is float64, which only the CPU backend takes", x.double())
        raises(r"x must be float32, float16, bfloat16 or \(CPU\) float64, got int32", x.int())
        raises("x must have a contiguous last dimension", x.t())
        raises("x must have at least 1 dimension", x[0, 0])
        raises("approximate must be 'none' or 'tanh'", x, "erf")
        raises("approximate must be 'none' or 'tanh'", x, "")
    with pytest.raises(RuntimeError, match="ltx_kernels.geglu: x must have an even last dimension"):
        ltx_kernels.geglu(x[:, :63])


@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_gelu_matches_diffusers_gelu(device, approximate):
    activations = pytest.importorskip("diffusers.models.activations")
    module = activations.GELU(1024, 2048, approximate=approximate).to(device, torch.bfloat16)
    x = torch.randn(2, 33, 1024, device=device).to(torch.bfloat16)
    expected = module(x)
    out = ltx_kernels.gelu(module.proj(x), approximate)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert (out == expected).float().mean() > 0.99, "differs from diffusers' GELU"
    if approximate == "tanh":  # the projection and the activation as one GEMM
        fused = ltx_kernels.linear_gelu(x, module.proj.weight, module.proj.bias)
        assert rel_l2(fused, expected) <= 1e-2


@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_geglu_matches_diffusers_geglu(device, approximate):
    activations = pytest.importorskip("diffusers.models.activations")
    module = activations.GEGLU(1024, 1536).to(device, torch.bfloat16)
    if approximate == "tanh":  # diffusers' GEGLU uses the exact GELU; patch it to compare tanh
        module.gelu = lambda gate: F.gelu(gate, approximate="tanh")
    x = torch.randn(2, 33, 1024, device=device).to(torch.bfloat16)
    expected = module(x)
    out = ltx_kernels.geglu(module.proj(x), approximate)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    assert (out == expected).float().mean() > 0.99, "differs from diffusers' GEGLU"


# ------------------------------------------------------------------------------------------------
# linear_gelu: gelu_tanh(x @ weight^T + bias), a GEMM: compared within GEMM tolerance
# ------------------------------------------------------------------------------------------------
REL_L2 = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_l2(out, expected):
    out, expected = out.double(), expected.double()
    return ((out - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def check_linear_gelu(x, weight, bias, what=""):
    what = (
        f"{what} linear_gelu x {tuple(x.shape)}/{x.dtype} weight {tuple(weight.shape)} "
        f"bias {None if bias is None else tuple(bias.shape)}"
    )
    out_shape = (*x.shape[:-1], weight.shape[0])
    poison_allocator(x.device.type, x.numel() // x.shape[-1] * weight.shape[0] * x.element_size())
    out = ltx_kernels.linear_gelu(x, weight, bias)
    assert_new_contiguous([out], [x, weight, bias], x.dtype, out_shape, what)
    if out.numel() == 0:
        return out
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    exact = reference.linear_gelu(x, weight, bias, compute_dtype=torch.float64, round_output=False)
    assert rel_l2(out, exact) <= REL_L2[x.dtype], f"{what}: rel. L2 error {rel_l2(out, exact):.3g}"
    # Per element: the output rounding, a rounding of the GEMM result before the GELU
    # (|gelu'| <= 1.13), and fp32 accumulation over K (far below 2^-20 of sum |x_k w_k|).
    x64, w64 = x.double(), weight.double()
    linear = F.linear(x64, w64, None if bias is None else bias.double())
    accumulated = F.linear(x64.abs(), w64.abs(), None if bias is None else bias.double().abs())
    # cuBLAS may reduce fp16/bf16 GEMMs in reduced precision (torch's default
    # allow_{bf16,fp16}_reduced_precision_reduction): 16-bit inputs get one 16-bit ulp of
    # sum |x_k w_k| for the accumulation.
    accumulation = 2.0**-20 if x.dtype == torch.float32 else 2.0 ** -MANTISSA_BITS[x.dtype]
    allowed = (
        2.0 ** -MANTISSA_BITS[x.dtype] * (1.2 * linear.abs() + exact.abs())
        + accumulation * accumulated
    )
    excess = ((out.double() - exact).abs() / allowed).max().item()
    assert excess <= 1.0, f"{what}: an element is {excess:.2f}x over the GEMM error bound"
    return out


def make_linear(rows, k, n, dtype, device, with_bias=True, layout="contiguous"):
    x = make_activation((rows, k), dtype, device, layout)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    bias = (0.5 * torch.randn(n, device=device)).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(
    "rows,k,n", [(1, 111, 96), (7, 769, 333), (7, 2048, 256), (300, 1536, 512), (4096, 512, 384)]
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_gelu_matches_reference(device, dtype, rows, k, n, with_bias):
    check_linear_gelu(*make_linear(rows, k, n, dtype, device, with_bias))


@pytest.mark.parametrize("layout", ["row_strided", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_gelu_strided_and_batched(device, dtype, layout):
    x, weight, bias = make_linear(12, 256, 128, dtype, device, True, layout)
    check_linear_gelu(x, weight, bias)
    check_linear_gelu(x.unflatten(0, (3, 4)), weight, bias)  # [B, S, K]


def test_linear_gelu_empty(device):
    weight = torch.randn(32, 64, device=device).to(torch.bfloat16)
    for shape in ((0, 64), (2, 0, 64)):
        x = torch.randn(shape, device=device).to(torch.bfloat16)
        out = ltx_kernels.linear_gelu(x, weight, None)
        assert_new_contiguous([out], [], x.dtype, (*shape[:-1], 32), "empty")


def test_linear_gelu_errors(device):
    bf16 = torch.bfloat16
    x, weight, bias = make_linear(4, 64, 32, bf16, device)

    def raises(pattern, *args):
        with pytest.raises(RuntimeError, match=f"ltx_kernels.linear_gelu: {pattern}"):
            ltx_kernels.linear_gelu(*args)

    if device == "cpu":  # float64 on the CPU (gradcheck: test_gradcheck.py)
        assert ltx_kernels.linear_gelu(x.double(), weight.double(), None).dtype == torch.float64
    else:
        raises("x is float64, which only the CPU backend takes", x.double(), weight.double(), None)
    raises(r"x must be float32, float16, bfloat16 or \(CPU\) float64, got int32", x.int(), weight)
    raises(r"weight must have shape \[N, K\] with K = x.shape\[-1\]", x, weight[:, :63], bias)
    raises(r"weight must have shape \[N, K\] with K = x.shape\[-1\]", x, weight[0], bias)
    raises(r"bias must have shape \[N\]", x, weight, bias[:31])
    raises(r"bias must have shape \[N\]", x, weight, bias[None])
    raises("weight must have x's dtype", x, weight.float(), None)
    raises("bias must have x's dtype", x, weight, bias.float())


# ------------------------------------------------------------------------------------------------
# torch.library, torch.compile, CUDA graphs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(device, dtype):
    ops = torch.ops.ltx_kernels
    x, y, gate, _ = make_residual((2, 6, 96), dtype, device, "model", "unbind6", "row_strided")
    torch.library.opcheck(ops.gated_residual.default, (x, y, gate), {"upcast": False})
    torch.library.opcheck(ops.gated_residual.default, (x, y, gate.float()), {"upcast": True})
    torch.library.opcheck(ops.gated_residual.default, (x, y, None), {"upcast": False})
    for approximate in APPROXIMATE:
        torch.library.opcheck(ops.gelu.default, (x, approximate))
        torch.library.opcheck(ops.geglu.default, (x, approximate))
    xl, weight, bias = make_linear(10, 64, 48, dtype, device)
    torch.library.opcheck(ops.linear_gelu.default, (xl.unflatten(0, (2, 5)), weight, bias))
    torch.library.opcheck(ops.linear_gelu.default, (xl, weight, None))


def _block(x, attn, modulation, weight, bias):
    """A DiT feed-forward: gated residual with a gate unbound inside the graph, GELU projection,
    GEGLU."""
    gate = modulation.unbind(2)[2]
    h = ltx_kernels.gated_residual(x, attn, gate)
    projected = ltx_kernels.linear_gelu(h, weight, bias)
    return h * 2 + 1, ltx_kernels.geglu(projected), ltx_kernels.gelu(projected, "none")


def test_compile_fullgraph_no_recompile(device):
    bf16 = torch.bfloat16
    modulation = torch.randn(2, 1, 6, 128, device=device).to(bf16)
    weight = (torch.randn(256, 128, device=device) / 12).to(bf16)
    bias = torch.randn(256, device=device).to(bf16)
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
    bf16 = torch.bfloat16
    x, y, gate, _ = make_residual((2, 64, 2048), bf16, "cuda", "model", "unbind6")
    gate32 = gate.float()
    xl, weight, bias = make_linear(128, 2048, 512, bf16, "cuda")

    def step():
        return (
            ltx_kernels.gated_residual(x, y, gate),
            ltx_kernels.gated_residual(x, y, gate32, upcast=True),
            ltx_kernels.gelu(x, "tanh"),
            ltx_kernels.geglu(x, "none"),
            ltx_kernels.linear_gelu(xl, weight, bias),
        )

    graph, outs = capture_graph(step)
    for _ in range(2):  # new data in the captured inputs, then replay
        for t in (x, y, xl):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        residual, residual32, gelu_out, geglu_out, linear_out = outs
        assert torch.equal(residual, ltx_kernels.gated_residual(x, y, gate))
        assert torch.equal(residual32, ltx_kernels.gated_residual(x, y, gate32, upcast=True))
        assert torch.equal(gelu_out, ltx_kernels.gelu(x, "tanh"))
        assert torch.equal(geglu_out, ltx_kernels.geglu(x, "none"))
        check_gated_residual(x, y, gate, False, "graph replay")
        check_gelu(x, "tanh", "graph replay")
        check_geglu(x, "none", "graph replay")
        check_linear_gelu(xl, weight, bias, "graph replay")
        assert rel_l2(linear_out, ltx_kernels.linear_gelu(xl, weight, bias)) <= 1e-6
