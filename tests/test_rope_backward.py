"""The fused backward of rope and qk_rmsnorm_rope (rope_backward, qk_rmsnorm_rope_backward: the
launcher ltx_qk_norm_rope_backward, CUDA kernel and C twin) against float64 evaluations of the
VJP: rope's gradient element by element (one rounding), qk_rmsnorm_rope's (q, k and both norm
weights) by relative L2, in every dtype, pairs / halves / split tables in fp32 and in x's dtype,
every table broadcast form, the four q/k layouts (LTX, Wan, FLUX, FLUX heads-first), strided and
misaligned rows, odd sizes (scalar paths, a norm-only row of odd length), many chunks, empty
tensors; torch.autograd.gradcheck in float64 on the C twin's float64 path; opcheck; the CUDA row
limit and its reference fallback; autograd of both ops calls the fused ops, and cos/sin that
require grad take the reference VJP."""

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference
from ltx_kernels._op_namespace import ops

from helpers import DTYPES, assert_rounds_within, make_activation, OpNames, varied_rows
from test_rope import MODES, QK_TABLES, TABLE_DTYPES, make_qk, norm_weight, tables_for

# Relative L2 error of qk_rmsnorm_rope's gradients against the float64 VJP: fp32 math rounded once
# per gradient (bf16: 2^-9 at most per element, about 2^-9/sqrt(3) in L2), the weights' gradients
# fp32 sums over rows rounded once.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 6e-3}


def _vjp64(op, args, grads, **kwargs):
    """Gradients of every tensor argument of reference.<op> in float64 (rounding steps exact)."""
    leaves = [a.detach().double().requires_grad_() if torch.is_tensor(a) else a for a in args]
    outs = getattr(reference, op)(
        *leaves, **kwargs, compute_dtype=torch.float64, round_output=False
    )
    outs = outs if isinstance(outs, tuple) else (outs,)
    tensors = [a for a in leaves if torch.is_tensor(a)]
    return torch.autograd.grad(
        sum((o * g.double()).sum() for o, g in zip(outs, grads)), tensors, allow_unused=True
    )


def _op_grads(op, args, grads, wanted):
    """Gradients of the args at positions `wanted` through the op's autograd (the fused ops)."""
    leaves = [a.detach().requires_grad_() if i in wanted else a for i, a in enumerate(args)]
    outs = getattr(ltx_kernels, op)(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return torch.autograd.grad(
        sum((o.float() * g.float()).sum() for o, g in zip(outs, grads)),
        [leaves[i] for i in wanted],
    )


def _rel_l2(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------
# rope: dx = R^T grad, one rounding per element
# ------------------------------------------------------------------------------------------------
def check_rope_backward(x, cos, sin, interleaved, what, grad=None):
    if grad is None:
        grad = varied_rows(x.shape, x.dtype, x.device) if x.dim() == 3 else torch.randn_like(x)
    (dx,) = _op_grads("rope", (x, cos, sin, interleaved), [grad], [0])
    exact = _vjp64("rope", (x, cos, sin, interleaved), [grad])[0]
    # per element |d_lo c_lo| + |d_hi s_hi|: the transposed rotation of |grad| by |cos| and |sin|
    zeros = torch.zeros_like(cos)
    magnitude = (
        _vjp64("rope", (x, cos.abs(), zeros, interleaved), [grad.abs()])[0]
        + _vjp64("rope", (x, zeros, sin.abs(), interleaved), [grad.abs()])[0].abs()
    )
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert_rounds_within(dx, exact, what, slop_magnitude=magnitude)


@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["SD", "BSD", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_backward_tables_3d(device, dtype, kind, mode, table_dtype):
    # hidden 110: 55 pairs per row (odd, scalar tail); 2048: LTX's width.
    for hidden in (110, 2048):
        x = varied_rows((2, 9, hidden), dtype, device, "row_strided")
        cos, sin = tables_for(kind, x.shape, mode, table_dtype, dtype, device)
        check_rope_backward(x, cos, sin, MODES[mode][0], f"rope bwd {kind} {mode} {hidden}")


@pytest.mark.parametrize("head_dim", [64, 128, 72])
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["S_Dh", "1S1Dh", "BSHDh", "BHSDh_T"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_backward_tables_per_head(device, dtype, kind, mode, table_dtype, head_dim):
    x = torch.randn(2, 7, 3, head_dim, device=device).to(dtype)
    cos, sin = tables_for(kind, x.shape, mode, table_dtype, dtype, device)
    check_rope_backward(x, cos, sin, MODES[mode][0], f"rope bwd {kind} {mode} Dh {head_dim}")


@pytest.mark.parametrize("layout", ["row_strided", "misaligned"])
@pytest.mark.parametrize("mode", MODES)
def test_rope_backward_strided_grad(device, layout, mode):
    # The output gradient as a strided (or misaligned: element-wise path) view.
    x = make_activation((2, 9, 128), torch.bfloat16, device, layout)
    cos, sin = tables_for("BSD", x.shape, mode, "fp32", torch.bfloat16, device)
    grad = make_activation((2, 9, 128), torch.bfloat16, device, layout)
    check_rope_backward(x, cos, sin, MODES[mode][0], f"rope bwd {layout} {mode}", grad)


# ------------------------------------------------------------------------------------------------
# qk_rmsnorm_rope: q, k and the norm weights
# ------------------------------------------------------------------------------------------------
def check_qk_backward(q, k, q_weight, k_weight, cos, sin, across_heads, interleaved, what):
    dtype = q.dtype
    args = (q, k, q_weight, k_weight, cos, sin, 1e-6, across_heads, interleaved)
    grads = [torch.randn(q.shape, device=q.device).to(dtype), torch.randn_like(k)]
    wanted = [i for i in range(4) if args[i] is not None]
    got = _op_grads("qk_rmsnorm_rope", args, grads, wanted)
    want = _vjp64("qk_rmsnorm_rope", args, grads)
    for i, g in zip(wanted, got):
        assert g.shape == args[i].shape and g.dtype == args[i].dtype, f"{what}: grad {i}"
        error = _rel_l2(g, want[i])
        assert error <= TOLERANCE[dtype], f"{what}: grad of input {i}: relative L2 {error:.3g}"


@pytest.mark.parametrize("weight_kind", ["none", "same", "fp32"])
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["ltx", "wan", "flux", "flux_bhsd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_backward_matches_float64(device, dtype, kind, mode, table_dtype, weight_kind):
    q, k, across = make_qk(
        kind, dtype, device, layout="row_strided" if kind == "ltx" else "contiguous"
    )
    row = q.shape[-1] * (q.shape[-2] if across and q.dim() == 4 else 1)
    q_weight, k_weight = (norm_weight(weight_kind, row, dtype, device) for _ in range(2))
    cos, sin = tables_for(QK_TABLES[kind], q.shape, mode, table_dtype, dtype, device)
    check_qk_backward(
        q, k, q_weight, k_weight, cos, sin, across, MODES[mode][0], f"qk bwd {kind} {mode}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_backward_norm_only_odd_rows_and_cross_attention(device, dtype):
    # No rotation, rows of 37 (odd: element-wise path with a lone last element); k longer than q.
    q = make_activation((2, 5, 37), dtype, device, "misaligned")
    k = torch.randn(2, 11, 37, device=device).to(dtype)
    q_weight, k_weight = (norm_weight("same", 37, dtype, device) for _ in range(2))
    check_qk_backward(q, k, q_weight, k_weight, None, None, True, True, "qk bwd norm only")


def test_qk_backward_many_chunks(device):
    # 2 x 2 x 1500 rows: many chunks of q and of k, each summing its rows' weight-gradient terms.
    q, k = (torch.randn(2, 1500, 256, device=device).to(torch.bfloat16) for _ in range(2))
    q_weight, k_weight = (norm_weight("fp32", 256, torch.bfloat16, device) for _ in range(2))
    cos, sin = tables_for("SD", q.shape, "pairs", "fp32", torch.bfloat16, device)
    check_qk_backward(q, k, q_weight, k_weight, cos, sin, True, True, "qk bwd many chunks")


@pytest.mark.parametrize("op", ["rope", "qk_rmsnorm_rope"])
def test_empty(device, op):
    x = torch.empty(2, 0, 64, device=device, dtype=torch.bfloat16)
    cos, sin = tables_for("BSD", x.shape, "pairs", "fp32", torch.bfloat16, device)
    if op == "rope":
        assert ops.rope_backward(x, cos, sin, True).shape == x.shape
        return
    w = torch.ones(64, device=device, dtype=torch.bfloat16)
    dq, dk, dqw, dkw = ops.qk_rmsnorm_rope_backward(
        x, x, x, x, w, w, cos, sin, 1e-6, True, True, [True, True]
    )
    assert dq.shape == x.shape and dk.shape == x.shape
    assert torch.equal(dqw, torch.zeros_like(w)) and torch.equal(dkw, torch.zeros_like(w))


# ------------------------------------------------------------------------------------------------
# gradcheck on the C twin's float64 path, opcheck, errors, autograd wiring
# ------------------------------------------------------------------------------------------------
def _fused_function(op):
    """op's forward as its float64 reference with its fused backward op (rope_backward or
    qk_rmsnorm_rope_backward), called as autograd_ops.cpp calls it, as its backward: gradcheck
    checks the backward op's C twin (float64) alone against finite differences (the op itself,
    its forward C twin in float64 too: test_gradcheck.py)."""

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            return getattr(reference, op)(*args, compute_dtype=torch.float64, round_output=False)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.inputs = inputs

        @staticmethod
        def backward(ctx, *grads):
            if op == "rope":
                _, cos, sin, interleaved = ctx.inputs
                return (
                    ops.rope_backward(grads[0].contiguous(), cos, sin, interleaved),
                    None,
                    None,
                    None,
                )
            q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved = ctx.inputs
            computed = ops.qk_rmsnorm_rope_backward(
                grads[0].contiguous(),
                grads[1].contiguous(),
                q,
                k,
                q_weight,
                k_weight,
                cos,
                sin,
                eps,
                across_heads,
                interleaved,
                [True, True],
            )
            return (*computed, None, None, None, None, None)

    return Fused.apply


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64_on_the_c_backend(mode):
    interleaved = MODES[mode][0]
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    cos, sin = tables_for("BSHDh", x.shape, mode, "fp32", torch.float64, "cpu")
    cos, sin = cos.double(), sin.double()
    rope = _fused_function("rope")
    assert torch.autograd.gradcheck(lambda t: rope(t, cos, sin, interleaved), (x.requires_grad_(),))
    for across in (True, False):
        q, k = (torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
        width = 24 if across else 8
        q_weight, k_weight = (
            (1 + 0.3 * torch.randn(width, dtype=torch.float64)).requires_grad_() for _ in range(2)
        )
        qk = _fused_function("qk_rmsnorm_rope")
        assert torch.autograd.gradcheck(
            lambda *t: qk(*t, cos, sin, 1e-6, across, interleaved), (q, k, q_weight, k_weight)
        )


def test_opcheck(device):
    x = torch.randn(2, 6, 3, 16, device=device)
    cos, sin = tables_for("S_Dh", x.shape, "halves", "fp32", torch.float32, device)
    torch.library.opcheck(ops.rope_backward, (x, cos, sin, False))
    q, k = (torch.randn(2, 6, 48, device=device) for _ in range(2))
    w = torch.randn(48, device=device)
    cos, sin = tables_for("BSD", q.shape, "pairs", "same", torch.float32, device)
    torch.library.opcheck(
        ops.qk_rmsnorm_rope_backward, (q, k, q, k, w, w, cos, sin, 1e-6, True, True, [True, False])
    )


def test_errors(device):
    q = torch.randn(2, 6, 48, device=device)
    with pytest.raises(RuntimeError, match="qk_rmsnorm_rope_backward: grad_k must have k's shape"):
        ops.qk_rmsnorm_rope_backward(
            q, q[:, :5], q, q, None, None, None, None, 1e-6, True, True, [False, False]
        )
    cos, sin = tables_for("BSD", q.shape, "pairs", "fp32", torch.float32, device)
    with pytest.raises(RuntimeError, match="rope_backward: cos and sin must have the same shape"):
        ops.rope_backward(q, cos, sin[..., :24], True)


@pytest.mark.gpu
def test_rows_above_the_cuda_limit_take_the_reference():
    # q/k rows of 8200 elements (norm across heads): the autograd takes the reference VJP; the
    # backward op itself names the limit.
    q, k = (torch.randn(1, 3, 2, 4100, device="cuda").to(torch.bfloat16) for _ in range(2))
    check_qk_backward(q, k, None, None, None, None, True, True, "qk bwd rows of 8200")
    with pytest.raises(RuntimeError, match="qk_rmsnorm_rope_backward: the CUDA kernel takes rows"):
        ops.qk_rmsnorm_rope_backward(
            q, k, q, k, None, None, None, None, 1e-6, True, True, [False, False]
        )


@pytest.mark.parametrize("op", ["rope", "qk_rmsnorm_rope"])
def test_autograd_calls_the_fused_op(device, op):
    q, k, across = make_qk("wan", torch.bfloat16, device)
    cos, sin = tables_for("1S1Dh", q.shape, "pairs", "fp32", torch.bfloat16, device)
    leaf = q.detach().requires_grad_()
    if op == "rope":
        outs = (ltx_kernels.rope(leaf, cos, sin, True),)
    else:
        outs = ltx_kernels.qk_rmsnorm_rope(leaf, k, None, None, cos, sin, 1e-6, across, True)
    with OpNames() as recorder:
        torch.autograd.grad(sum(o.float().sum() for o in outs), leaf)
    assert f"ltx_kernels::{op}_backward" in recorder.names


def test_cos_sin_requiring_grad_take_the_reference(device):
    x = torch.randn(2, 7, 64, device=device)
    cos, sin = (
        t.requires_grad_() for t in tables_for("SD", x.shape, "pairs", "fp32", x.dtype, device)
    )
    grad = torch.randn_like(x)
    got = torch.autograd.grad((ltx_kernels.rope(x, cos, sin, True) * grad).sum(), (cos, sin))
    want = _vjp64("rope", (x, cos, sin, True), [grad])[1:]
    for g, w in zip(got, want):
        assert _rel_l2(g, w) <= 1e-6
