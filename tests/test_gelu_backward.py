"""The fused backward of gelu and geglu (ltx_kernels.gelu_backward / geglu_backward, CUDA kernel
and C twin) against float64 evaluations of the VJP with the forward's rounding points, on CPU and
CUDA: every dtype, odd hidden sizes, 1/7/4096 rows, strided and misaligned rows of x and of the
output gradient, the whole input range, empty tensors, opcheck, bad inputs, CUDA-graph capture of
forward + backward; torch.autograd.gradcheck in float64 on the C twin's float64 path (the op's
own code, forward and backward, not the reference); autograd of gelu/geglu calls the fused op (and its
gradients are what the composite VJP gives)."""

import pytest
import torch
import torch.nn.functional as F

import ltx_kernels
from ltx_kernels._op_namespace import ops

from helpers import (
    DTYPES,
    LAYOUTS,
    assert_new_contiguous,
    assert_rounds_within,
    capture_graph,
    gelu_range,
    make_activation,
    OpNames,
    poison_allocator,
    rows_hidden_cases,
    skip_big_on_cpu,
    varied_rows,
)

APPROXIMATE = ["none", "tanh"]


def _slope(x64: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu'(x) in float64."""
    return torch.ops.aten.gelu_backward(torch.ones_like(x64), x64, approximate=approximate)


def _slope_terms(x64: torch.Tensor, approximate: str) -> torch.Tensor:
    """The magnitude of the terms the fp32 slope is summed from: 1 (Phi, or s(t)) plus |x| times
    the largest factor of the second term (phi(x) <= 0.4; s(t) s(-t) dt/dx <= 0.4 (1 + 0.134 x^2))."""
    extra = 0.4 * (1 + 0.134145 * x64**2) if approximate == "tanh" else 0.4
    return 1 + x64.abs() * extra


def check_gelu_backward(x, dout, approximate, what=""):
    what = f"{what} gelu_backward({approximate}) x {tuple(x.shape)}/{x.dtype}"
    poison_allocator(x.device.type, x.numel() * x.element_size())
    dx = ops.gelu_backward(dout, x, approximate)
    assert_new_contiguous([dx], [x, dout], x.dtype, x.shape, what)
    x64, d64 = x.double(), dout.double()
    exact = d64 * _slope(x64, approximate)
    assert_rounds_within(dx, exact, what, slop_magnitude=d64.abs() * _slope_terms(x64, approximate))
    return dx


def check_geglu_backward(x, dout, approximate, what=""):
    what = f"{what} geglu_backward({approximate}) x {tuple(x.shape)}/{x.dtype}"
    poison_allocator(x.device.type, x.numel() * x.element_size())
    dx = ops.geglu_backward(dout, x, approximate)
    assert_new_contiguous([dx], [x, dout], x.dtype, x.shape, what)
    h, g = (t.double() for t in x.chunk(2, dim=-1))
    d64 = dout.double()
    gelu_g = F.gelu(g, approximate=approximate)
    # dh = round_T(dout * round_T(gelu(g))): one intermediate rounding, of gelu(g).
    exact_h = d64 * gelu_g.to(x.dtype).double()
    assert_rounds_within(
        dx[..., : h.shape[-1]],
        exact_h,
        what + " [grad of hidden]",
        roundings=1,
        magnitude=(d64 * gelu_g).abs(),
        slop_magnitude=d64.abs() * (gelu_g.abs() + g.abs()),
        intermediate_scale=float(d64.abs().max()),
    )
    # dg = round_T(gelu'(g) * round_T(dout * h)): one intermediate rounding, of dout * h.
    slope = _slope(g, approximate)
    exact_g = slope * (d64 * h).to(x.dtype).double()
    assert_rounds_within(
        dx[..., h.shape[-1] :],
        exact_g,
        what + " [grad of gate]",
        roundings=1,
        magnitude=(slope * d64 * h).abs(),
        slop_magnitude=(d64 * h).abs() * _slope_terms(g, approximate),
        intermediate_scale=float(slope.abs().max()),
    )
    return dx


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("rows,hidden", rows_hidden_cases())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_backward_matches_float64(device, dtype, rows, hidden, approximate):
    skip_big_on_cpu(device, rows, hidden, keep=approximate == "tanh")
    x = varied_rows((rows, hidden), dtype, device) * 0.5
    check_gelu_backward(x, varied_rows((rows, hidden), dtype, device), approximate)


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("rows,hidden", rows_hidden_cases())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_geglu_backward_matches_float64(device, dtype, rows, hidden, approximate):
    skip_big_on_cpu(device, rows, hidden, keep=approximate == "none")
    x = varied_rows((rows, 2 * hidden), dtype, device) * 0.5
    check_geglu_backward(x, varied_rows((rows, hidden), dtype, device), approximate)


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_over_the_whole_range(device, dtype, approximate):
    x = gelu_range(dtype, device)
    dout = torch.randn_like(x, dtype=torch.float32).to(dtype)
    check_gelu_backward(x, dout, approximate)
    gated = torch.cat([torch.randn_like(x, dtype=torch.float32).to(dtype), x], dim=-1)
    check_geglu_backward(gated, dout, approximate)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_of_strided_and_misaligned_rows(device, dtype, layout):
    # Each operand alone in the layout (the others contiguous), then all of them.
    for hidden in (64, 769):
        for strided in ("x", "dout", "both"):
            x_layout = layout if strided in ("x", "both") else "contiguous"
            d_layout = layout if strided in ("dout", "both") else "contiguous"
            x = make_activation((3, 5, hidden), dtype, device, x_layout)
            check_gelu_backward(x, make_activation((3, 5, hidden), dtype, device, d_layout), "tanh")
            gated = make_activation((3, 5, 2 * hidden), dtype, device, x_layout)
            dout = make_activation((3, 5, hidden), dtype, device, d_layout)
            check_geglu_backward(gated, dout, "none")


def test_backward_of_a_projection_chunk(device):
    # geglu's input as a chunk of a wider projection, its gradient as a batched view.
    base = torch.randn(4, 9, 2048, device=device).to(torch.bfloat16)
    dout = torch.randn(4, 9, 1024, device=device).to(torch.bfloat16)
    check_geglu_backward(base[..., 512:1536], dout[..., :512], "none")
    check_gelu_backward(base[:, ::2, 100:611], dout[:, ::2, 1:512], "tanh")


@pytest.mark.parametrize("shape", [(0, 64), (3, 0, 64), (4, 0)])
def test_backward_of_empty_tensors(device, shape):
    x = torch.randn(shape, device=device).to(torch.bfloat16)
    dx = ops.gelu_backward(torch.randn(shape, device=device).to(torch.bfloat16), x, "tanh")
    assert dx.shape == x.shape and dx.dtype == x.dtype
    half = (*shape[:-1], shape[-1] // 2)
    dx = ops.geglu_backward(torch.randn(half, device=device).to(torch.bfloat16), x, "none")
    assert dx.shape == x.shape


@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_gradcheck_float64_on_the_c_backend(approximate):
    # Forward and backward run the C twin in double: gradcheck compares the fused backward with
    # finite differences of the op's own forward (second derivatives raise: test_autograd.py).
    x = (torch.randn(3, 10, dtype=torch.float64) * 2).requires_grad_()
    for fn in (ltx_kernels.gelu, ltx_kernels.geglu):
        assert torch.autograd.gradcheck(lambda t: fn(t, approximate), (x,))


def test_float64_is_the_c_backend_only(device):
    x = torch.randn(2, 8, dtype=torch.float64, device=device)
    if device == "cpu":
        assert ltx_kernels.gelu(x).dtype == torch.float64
        return
    with pytest.raises(RuntimeError, match="ltx_kernels.gelu: x is float64, which only the CPU"):
        ltx_kernels.gelu(x)
    with pytest.raises(RuntimeError, match="ltx_kernels.geglu_backward: x is float64"):
        ops.geglu_backward(torch.randn(2, 4, dtype=torch.float64, device=device), x, "none")


@pytest.mark.parametrize("name", ["gelu_backward", "geglu_backward"])
def test_opcheck(device, name):
    x = torch.randn(3, 5, 64, device=device).to(torch.bfloat16)
    dout = torch.randn(3, 5, 64 if name == "gelu_backward" else 32, device=device).to(x.dtype)
    for approximate in APPROXIMATE:
        torch.library.opcheck(getattr(ops, name), (dout, x, approximate))


def test_bad_inputs(device):
    x = torch.randn(2, 64, device=device).to(torch.bfloat16)
    with pytest.raises(
        RuntimeError,
        match=r"ltx_kernels.gelu_backward: grad_out must have the output's shape \[2, 64\]",
    ):
        ops.gelu_backward(torch.randn(2, 32, device=device).to(x.dtype), x, "tanh")
    with pytest.raises(
        RuntimeError,
        match=r"ltx_kernels.geglu_backward: grad_out must have the output's shape \[2, 32\]",
    ):
        ops.geglu_backward(torch.randn(2, 64, device=device).to(x.dtype), x, "none")
    with pytest.raises(
        RuntimeError, match="ltx_kernels.gelu_backward: grad_out must have x's dtype"
    ):
        ops.gelu_backward(torch.randn(2, 64, device=device), x, "tanh")
    with pytest.raises(RuntimeError, match="ltx_kernels.gelu_backward: approximate must be"):
        ops.gelu_backward(torch.randn(2, 64, device=device).to(x.dtype), x, "exact")
    with pytest.raises(RuntimeError, match="ltx_kernels.geglu_backward: x must have an even last"):
        ops.geglu_backward(torch.randn(2, 31, device=device).to(x.dtype), x[:, :63], "none")
    with pytest.raises(
        RuntimeError, match="ltx_kernels.gelu_backward: grad_out must have a contiguous last"
    ):
        ops.gelu_backward(torch.randn(64, 2, device=device).to(x.dtype).t(), x, "tanh")


@pytest.mark.parametrize("op", ["gelu", "geglu"])
def test_autograd_runs_the_fused_backward(device, op):
    x = torch.randn(4, 7, 256, device=device).to(torch.bfloat16).requires_grad_()
    out = getattr(ltx_kernels, op)(x)
    dout = torch.randn_like(out)
    with OpNames() as seen:
        (grad,) = torch.autograd.grad(out, x, dout)
    assert f"ltx_kernels::{op}_backward" in seen.names, sorted(seen.names)
    # The fused kernel's gradient is the composite VJP's (same rounding points): equal up to the
    # fp32 evaluation of gelu' (a rounding boundary now and then).
    composite = torch.autograd.grad(
        getattr(ltx_kernels.reference, op)(x, compute_dtype=torch.float32), x, dout
    )[0]
    assert (grad == composite).float().mean() > 0.99


def test_backward_ops_are_not_differentiable(device):
    x = torch.randn(2, 8, device=device, requires_grad=True)
    dout = torch.randn(2, 8, device=device, requires_grad=True)
    dx = ops.gelu_backward(dout, x, "tanh")
    with pytest.raises(RuntimeError, match="ltx_kernels.gelu_backward is not differentiable"):
        dx.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gelu", "geglu"])
def test_cuda_graph_forward_backward(op):
    # Forward and fused backward captured in one CUDA graph; the replay reproduces the eager
    # gradient bit for bit (no host synchronization, no allocation outside the graph pool).
    x = torch.randn(3, 37, 512, device="cuda").to(torch.bfloat16).requires_grad_()
    width = 512 if op == "gelu" else 256
    dout = torch.randn(3, 37, width, device="cuda").to(torch.bfloat16)

    def step():
        x.grad = None
        getattr(ltx_kernels, op)(x).backward(dout)
        return x.grad

    graph, captured = capture_graph(step)
    expected = step().clone()
    with torch.no_grad():
        x.add_(0)  # same values: the replay must give the eager gradient
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, expected, rtol=0, atol=0)
