"""ltx_kernels.rmsnorm against a float64 reference with diffusers' rounding points, on CPU and
CUDA: every dtype, odd hidden sizes, weight None / same dtype / fp32, strided and misaligned rows,
empty tensors, opcheck, torch.compile, CUDA graphs, 64-bit offsets and bad inputs."""

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference

from helpers import (
    assert_compiles_once,
    assert_rounds_exact,
    capture_graph,
    make_activation,
    poison_allocator,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [64, 111, 769, 2048, 3072, 5125]
ROWS = [1, 7, 4096]
WEIGHTS = ["none", "same", "fp32"]
LAYOUTS = ["contiguous", "row_strided", "misaligned"]


def make_weight(kind, hidden, dtype, device):
    if kind == "none":
        return None
    w_dtype = dtype if kind == "same" else torch.float32
    return (1 + 0.5 * torch.randn(hidden, device=device)).to(w_dtype)


def exact_rmsnorm(x, weight=None, eps=1e-6):
    return reference.rmsnorm(x, weight, eps, compute_dtype=torch.float64, round_output=False)


def assert_is_exact_rmsnorm(out, x, weight=None, eps=1e-6, what=""):
    """out is the correctly rounded rmsnorm(x, weight, eps). A fp16/bf16 weight adds a rounding
    point (y is rounded to the weight dtype before the product, then scaled by up to max|w|)."""
    intermediate, scale = None, 1.0
    if weight is not None and weight.dtype != torch.float32:
        intermediate = weight.dtype
        scale = weight.abs().max().item() if weight.numel() else 1.0
    assert_rounds_exact(out, exact_rmsnorm(x, weight, eps), what, intermediate, scale)


def run_and_check(x, weight, eps=1e-6):
    out_dtype = weight.dtype if weight is not None else x.dtype
    poison_allocator(x.device.type, x.numel() * torch.finfo(out_dtype).bits // 8)
    out = ltx_kernels.rmsnorm(x, weight, eps)
    assert out.dtype == out_dtype and out.shape == x.shape and out.is_contiguous()
    what = f"{tuple(x.shape)} {x.dtype} weight {weight.dtype if weight is not None else None}"
    assert_is_exact_rmsnorm(out, x, weight, eps, what)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("weight_kind", WEIGHTS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(device, dtype, hidden, rows, weight_kind, layout):
    x = make_activation((rows, hidden), dtype, device, layout)
    x = x * torch.rand(rows, 1, device=device).add(0.05).to(dtype) * 8  # rows of varied scale
    run_and_check(x, make_weight(weight_kind, hidden, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
def test_every_weight_dtype(device, dtype, w_dtype):
    # Mixed precision either way: bf16 x with fp16 weight, fp32 x with bf16 weight, ...
    x = torch.randn(33, 1536, device=device).to(dtype)
    run_and_check(x, torch.randn(1536, device=device).to(w_dtype))


@pytest.mark.parametrize("hidden", [8, 16, 24, 40, 4096, 5120, 8192, 12288, 20000, 70000])
def test_hidden_size_paths(device, hidden):
    # Row widths that take every kernel path: one thread per row, one warp, several warps, the
    # largest register-cached rows, and the streaming path for rows too long to cache.
    x = torch.randn(5, hidden, device=device).to(torch.bfloat16)
    run_and_check(x, make_weight("same", hidden, torch.bfloat16, device))
    run_and_check(x[:, 1:], None)  # misaligned: scalar path


def test_batched_views_without_copy(device):
    # [B, S, D] views whose rows are not evenly spaced: a chunk along S, a step along S, and a
    # head-split [B, S, H, Dh] view of a [B, H, S, Dh] tensor (three row levels).
    base = torch.randn(3, 10, 256, device=device).to(torch.bfloat16)
    run_and_check(base.chunk(2, dim=1)[1], None)
    run_and_check(base[:, ::3], None)
    heads = torch.randn(2, 4, 9, 64, device=device).to(torch.float16).transpose(1, 2)
    run_and_check(heads, torch.randn(64, device=device).to(torch.float16))


def test_unaddressable_rows_raise(device):
    x = torch.randn(3, 4, 5, 6, 32, device=device)[:, ::2, :, ::2].transpose(1, 2)
    with pytest.raises(RuntimeError, match="x with shape .* more than 3 unmergeable"):
        ltx_kernels.rmsnorm(x)


@pytest.mark.parametrize("shape", [(0, 64), (4, 0), (2, 0, 128), (0,)])
@pytest.mark.parametrize("weight_kind", ["none", "fp32"])
def test_empty(device, shape, weight_kind):
    x = torch.randn(shape, device=device).to(torch.bfloat16)
    w = make_weight(weight_kind, shape[-1], torch.bfloat16, device)
    out = ltx_kernels.rmsnorm(x, w)
    assert out.shape == x.shape and out.dtype == (
        torch.float32 if w is not None else torch.bfloat16
    )


def test_eps_is_used(device):
    x = 1e-3 * torch.randn(16, 256, device=device)
    for eps in (0.0, 1e-6, 1e-2):
        run_and_check(x, None, eps)


def test_64bit_offsets(device):
    # Row 1 starts 2^31 elements into the buffer: 32-bit offsets would wrap. Only the two rows
    # are touched, so the 4 GiB buffer costs nothing on the CPU.
    hidden = 2048
    try:
        buf = torch.empty(2**31 + hidden, dtype=torch.bfloat16, device=device)
    except (RuntimeError, MemoryError):  # pragma: no cover - depends on the machine
        pytest.skip("cannot allocate a 4 GiB buffer")
    x = buf.as_strided((2, hidden), (2**31, 1))
    x.copy_(torch.randn(2, hidden, device=device))
    run_and_check(x, None)
    del buf, x


def test_errors_name_the_argument(device):
    x = torch.randn(4, 64, device=device)
    rms = ltx_kernels.rmsnorm
    if device == "cpu":  # float64 runs the C twin in double (gradcheck: test_gradcheck.py)
        assert rms(x.double(), torch.ones(64, dtype=torch.float64)).dtype == torch.float64
        with pytest.raises(
            RuntimeError,
            match="ltx_kernels.rmsnorm: weight must have x's dtype float64, got float32",
        ):
            rms(x.double(), torch.ones(64))
    else:
        with pytest.raises(
            RuntimeError,
            match="ltx_kernels.rmsnorm: x is float64, which only the CPU backend takes",
        ):
            rms(x.double())
    with pytest.raises(
        RuntimeError, match=r"x must be float32, float16, bfloat16 or \(CPU\) float64, got int32"
    ):
        rms(x.int())
    with pytest.raises(RuntimeError, match="x must have a contiguous last dimension"):
        rms(x.t())
    with pytest.raises(RuntimeError, match="x must have at least 1 dimension"):
        rms(x[0, 0])
    with pytest.raises(RuntimeError, match=r"weight must have shape \[hidden\] = \[64\].*\[32\]"):
        rms(x, torch.ones(32, device=device))
    with pytest.raises(RuntimeError, match=r"weight must have shape \[hidden\]"):
        rms(x, torch.ones(1, 64, device=device))
    with pytest.raises(RuntimeError, match="weight must be float32, float16 or bfloat16"):
        rms(x, torch.ones(64, device=device, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        rms(x, torch.ones(128, device=device)[::2])
    with pytest.raises(RuntimeError, match="eps must be finite and >= 0"):
        rms(x, None, -1.0)
    with pytest.raises(RuntimeError, match="eps must be finite and >= 0"):
        rms(x, None, float("nan"))


@pytest.mark.gpu
def test_device_mismatch_raises():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match="weight is on cpu but x is on cuda:0"):
        ltx_kernels.rmsnorm(x, torch.ones(64))
    with pytest.raises(RuntimeError, match="weight is on cuda:0 but x is on cpu"):
        ltx_kernels.rmsnorm(x.cpu(), torch.ones(64, device="cuda"))


@pytest.mark.parametrize("weight_kind", WEIGHTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(device, dtype, weight_kind):
    x = make_activation((3, 5, 96), dtype, device, "row_strided")
    w = make_weight(weight_kind, 96, dtype, device)
    torch.library.opcheck(torch.ops.ltx_kernels.rmsnorm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.ltx_kernels.rmsnorm.default, (x.contiguous(), None, 1e-5))


def test_compile_fullgraph_no_recompile(device):
    def block(x, w):
        return ltx_kernels.rmsnorm(x, w) * 2 + 1

    w = torch.randn(128, device=device).to(torch.bfloat16)
    assert_compiles_once(
        block, lambda seq: (torch.randn(2, seq, 128, device=device).to(torch.bfloat16), w)
    )


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    x = torch.randn(64, 2048, device="cuda").to(torch.bfloat16)
    w = torch.randn(2048, device="cuda").to(torch.bfloat16)
    graph, out = capture_graph(lambda: ltx_kernels.rmsnorm(x, w))
    for _ in range(2):  # new data in the captured input, then replay
        x.copy_(torch.randn_like(x, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        assert_is_exact_rmsnorm(out, x, w, what="graph replay")


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    x = torch.randn(4096, 3072, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = ltx_kernels.rmsnorm(x)
    stream.synchronize()
    assert_is_exact_rmsnorm(out, x, what="side stream")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_second_device():
    x = torch.randn(16, 512, device="cuda:1").to(torch.bfloat16)
    out = ltx_kernels.rmsnorm(x, torch.randn(512, device="cuda:1").to(torch.bfloat16))
    assert out.device == x.device


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_matches_diffusers_rmsnorm(device, affine, w_dtype):
    normalization = pytest.importorskip("diffusers.models.normalization")
    module = normalization.RMSNorm(1024, eps=1e-6, elementwise_affine=affine).to(device)
    if affine:
        with torch.no_grad():
            module.weight.copy_(1 + 0.3 * torch.randn(1024))
        module.to(w_dtype)
    x = torch.randn(3, 50, 1024, device=device).to(torch.bfloat16)
    expected = module(x)
    out = ltx_kernels.rmsnorm(x, module.weight, module.eps)
    assert out.dtype == expected.dtype
    # Same rounding points: identical but where the two fp32 sums of squares round apart.
    assert_is_exact_rmsnorm(out, x, module.weight, module.eps, "kernel")
    if out.dtype == torch.float32:  # fp32 outputs differ in the last bits (summation order)
        torch.testing.assert_close(out, expected, rtol=4 * 2.0**-19, atol=0)
    else:
        assert (out == expected).float().mean() > 0.99, "differs from diffusers' RMSNorm"
