"""Shared test helpers: ulp-based comparison against float64 references, output poisoning,
layouts of activations (contiguous, row-strided, misaligned), the names of the ops a call
dispatches."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
# frexp exponent of the smallest normal number (value = m * 2^e with 0.5 <= |m| < 1).
MIN_NORMAL_EXP = {torch.float32: -125, torch.float16: -13, torch.bfloat16: -125}


# Relative error budget of the fp32 arithmetic inside the kernels (sum of squares over up to ~10^5
# terms with a tree reduction, rsqrtf, products): about 1e-6, so 2^-19 leaves a 2x margin.
FP32_MATH_SLOP = 2.0**-19


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` numbers at the magnitude of `values` (float64)."""
    values = values.double()
    _, exp = torch.frexp(values)
    exp = exp.clamp(min=MIN_NORMAL_EXP[dtype])
    return torch.ldexp(torch.ones_like(values), exp - 1 - MANTISSA_BITS[dtype])


def assert_rounds_exact(
    out: torch.Tensor,
    exact: torch.Tensor,
    what: str = "",
    intermediate: torch.dtype | None = None,
    intermediate_scale: float = 1.0,
) -> None:
    """out must be the fp32-computed rounding of `exact` (the float64 value before the final
    rounding): |out - exact| <= 0.5 ulp of out.dtype + FP32_MATH_SLOP * |exact|, plus one ulp of
    `intermediate` where the op rounds an intermediate to that dtype (an fp32 value on a rounding
    boundary may round the other way): 2^-mantissa relative to |exact|, and at least the spacing of
    its subnormals times `intermediate_scale` (the largest factor applied after the rounding).
    NaN and inf never pass. For fp16/bf16 outputs at least 99% of the elements must equal the
    correctly rounded exact value."""
    assert out.shape == exact.shape, f"{what}: shape {tuple(out.shape)} != {tuple(exact.shape)}"
    if out.numel() == 0:
        return
    assert torch.isfinite(out).all(), f"{what}: non-finite values in the output"
    exact = exact.double()
    relative = FP32_MATH_SLOP + (2.0 ** -MANTISSA_BITS[intermediate] if intermediate else 0.0)
    # The final rounding happens at the magnitude of the fp32 value, which may sit one binade up.
    allowed = 0.5 * ulp(exact.abs() * (1 + relative), out.dtype) + relative * exact.abs()
    if intermediate:
        subnormal_spacing = 2.0 ** (MIN_NORMAL_EXP[intermediate] - 1 - MANTISSA_BITS[intermediate])
        allowed = allowed + subnormal_spacing * intermediate_scale
    excess = (out.double() - exact).abs() / allowed
    worst = excess.argmax()
    assert excess.max().item() <= 1.0, (
        f"{what}: error {excess.max().item():.3f}x the allowed bound at flat index {worst.item()} "
        f"(got {out.flatten()[worst].item()!r}, exact {exact.flatten()[worst].item()!r})"
    )
    if out.dtype != torch.float32:
        match = (out == exact.to(out.dtype)).float().mean().item()
        assert match >= 0.99, f"{what}: only {match:.4f} of the elements are correctly rounded"


def poison_allocator(device: str, nbytes: int) -> None:
    """Fill and free a block so the caching allocator hands NaN-filled memory to the next
    allocation of that size: outputs an op forgets to write then show up as NaN."""
    if device == "cuda":
        torch.full((nbytes // 4 + 1,), float("nan"), device=device)


def make_activation(shape, dtype, device, layout: str = "contiguous") -> torch.Tensor:
    """A random activation of `shape` in one of several memory layouts:
    contiguous; row_strided (a [..., :D] slice of rows padded by 8 elements, so 16-byte aligned);
    misaligned (rows padded by 3 and shifted by 1 element: no 16-byte alignment)."""
    *lead, hidden = shape
    if layout == "contiguous":
        return torch.randn(shape, device=device).to(dtype)
    if layout == "row_strided":
        return torch.randn(*lead, hidden + 8, device=device).to(dtype)[..., :hidden]
    if layout == "misaligned":
        return torch.randn(*lead, hidden + 4, device=device).to(dtype)[..., 1 : hidden + 1]
    raise ValueError(layout)


def assert_compiles_once(fn, args_for_length, lengths=(37, 91)):
    """torch.compile(fn, fullgraph=True, dynamic=True) traces without a graph break, does not
    recompile when the sequence length changes, and matches eager fn exactly.
    args_for_length(seq) -> fn's arguments; called once per length, in order."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    cases = [args_for_length(seq) for seq in lengths]
    with torch._dynamo.config.patch(error_on_recompile=False):
        outputs = [compiled(*cases[0])]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outputs += [compiled(*args) for args in cases[1:]]  # new sequence lengths
    for args, out in zip(cases, outputs):
        expected = fn(*args)
        if isinstance(out, torch.Tensor):
            out, expected = (out,), (expected,)
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def capture_graph(step):
    """Runs step() once on a side stream (warm-up outside the capture), then captures it in a CUDA
    graph. Returns (graph, outputs of the captured call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while active (`names`: "ltx_kernels::gelu", ...)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))
