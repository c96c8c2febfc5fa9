"""Shared test helpers: ulp-based comparison against float64 references (correctly rounded
outputs, and ops that round intermediates), output poisoning, layouts of activations (contiguous,
row-strided, misaligned), the names of the ops a call dispatches; and for the tests of the fused
ops (test_norm_modulate.py, test_residual_activations.py, test_rope.py and the backward tests):
their dtypes, sizes and row cases, modulation tensors in the layouts model code produces, and
output checks."""

import pytest
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


def assert_graph_replays_outputs(step):
    """A CUDA graph of step() (capture_graph; step returns a tuple of tensors) replays its eager
    outputs bit for bit, into outputs zeroed beforehand (compared as bytes: 8-bit codes too)."""
    graph, outputs = capture_graph(step)
    expected = [t.clone() for t in step()]
    for t in outputs:
        t.zero_()
    graph.replay()
    for got, want in zip(outputs, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while active (`names`: "ltx_kernels::gelu", ...)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


# ---- The fused ops' tests -----------------------------------------------------------------------
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Hidden sizes of the issue: odd ones (scalar tails, no 16-byte rows), the model widths (1536 Wan
# 1.3B, 2048 LTX, 3072 FLUX / SD3, 5120 Wan 14B) and 5125.
HIDDEN = [111, 769, 1536, 2048, 3072, 5120, 5125]
SMALL_ROWS = [1, 7]
BIG_ROWS = 4096
# The hidden sizes that run with 4096 rows on the CPU (all of them run with 4096 rows on CUDA).
BIG_ROWS_CPU_HIDDEN = (769, 1536)
LAYOUTS = ["contiguous", "row_strided", "misaligned"]


def rows_hidden_cases(hidden_sizes=HIDDEN):
    """(rows, hidden) pairs: 1, 7 and 4096 rows for every hidden size (see skip_big_on_cpu)."""
    return [(rows, hidden) for hidden in hidden_sizes for rows in (*SMALL_ROWS, BIG_ROWS)]


def skip_big_on_cpu(device, rows, hidden, keep=True, cpu_hidden=BIG_ROWS_CPU_HIDDEN):
    """Keeps the CPU run short (CI has 2 cores): 4096-row cases run on the CPU only for
    `cpu_hidden` and where `keep` (a subset of the other parameters); all of them on CUDA."""
    if device == "cpu" and rows >= BIG_ROWS and (hidden not in cpu_hidden or not keep):
        pytest.skip("4096 rows run on the CPU for a subset of the cases only")


def subnormal_spacing(dtype: torch.dtype) -> float:
    return 2.0 ** (MIN_NORMAL_EXP[dtype] - 1 - MANTISSA_BITS[dtype])


def assert_rounds_within(
    out: torch.Tensor,
    exact: torch.Tensor,
    what: str = "",
    *,
    roundings: int = 0,
    magnitude: torch.Tensor | None = None,
    slop_magnitude: torch.Tensor | None = None,
    intermediate_scale: float = 1.0,
) -> None:
    """out must be the fp32-computed rounding to out.dtype of `exact` (the float64 value of the
    same formula, rounded to out.dtype at the same intermediate points, before the final rounding).

    An op that rounds `roundings` intermediates to out.dtype may round one the other way (an fp32
    value on a rounding boundary), an error of up to one ulp of that intermediate, carried to the
    output by the later steps; `magnitude` bounds, per element, the intermediates' contribution
    to the output (for a modulation |n| * |1 + scale|, for RoPE after a norm |v| * (|cos| + |sin|)).
    `slop_magnitude` is the per-element sum of magnitudes of the terms computed in fp32 (the fp32
    arithmetic error is relative to it, not to a result that cancels; default: magnitude).
    `intermediate_scale` is the largest factor applied after an intermediate rounding (it scales
    the subnormal spacing, the absolute error floor of an intermediate near zero). The bound:
        budget = roundings * (2^-mantissa * magnitude + subnormal_spacing * intermediate_scale)
                 + FP32_MATH_SLOP * (slop_magnitude + |exact|)
        |out - exact| <= 0.5 ulp(|exact| + budget) + budget
    NaN and inf never pass. For fp16/bf16 outputs at least 99% of the elements that fp32
    arithmetic can round correctly (those farther than FP32_MATH_SLOP * (slop_magnitude + |exact|)
    from a rounding boundary: most of them, but not GELU's deep negative tail, where 1 + erf
    cancels) must equal exact rounded to out.dtype: that check catches a missing or extra
    rounding point, whose effect the budget would absorb.
    """
    assert out.shape == exact.shape, f"{what}: shape {tuple(out.shape)} != {tuple(exact.shape)}"
    if out.numel() == 0:
        return
    assert torch.isfinite(out).all(), f"{what}: non-finite values in the output"
    dtype = out.dtype
    exact = exact.double()
    magnitude = exact.abs() if magnitude is None else magnitude.double().expand(exact.shape)
    slop_magnitude = magnitude if slop_magnitude is None else slop_magnitude.double()
    fp32_budget = FP32_MATH_SLOP * (slop_magnitude + exact.abs())
    budget = fp32_budget
    if roundings:
        budget = budget + roundings * (
            2.0 ** -MANTISSA_BITS[dtype] * magnitude + subnormal_spacing(dtype) * intermediate_scale
        )
    allowed = 0.5 * ulp(exact.abs() + budget, dtype) + budget
    excess = (out.double() - exact).abs() / allowed
    worst = excess.argmax()
    assert excess.max().item() <= 1.0, (
        f"{what}: error {excess.max().item():.3f}x the allowed bound at flat index {worst.item()} "
        f"(got {out.flatten()[worst].item()!r}, exact {exact.flatten()[worst].item()!r}, "
        f"allowed {allowed.flatten()[worst].item():.3g})"
    )
    if dtype != torch.float32:
        decidable = (exact - fp32_budget).to(dtype) == (exact + fp32_budget).to(dtype)
        count = int(decidable.sum())
        assert count >= 0.5 * exact.numel() or exact.numel() < 100, (
            f"{what}: inputs too ill-conditioned, only {count} elements can be rounded exactly"
        )
        match = (out == exact.to(dtype))[decidable].float().mean().item() if count else 1.0
        assert match >= 0.99, f"{what}: only {match:.4f} of the elements are correctly rounded"


def assert_new_contiguous(outputs, inputs, dtype, shape, what=""):
    """Each output is a new contiguous tensor of `dtype` and `shape` that shares no memory with
    any input (None entries are skipped)."""
    input_storages = {
        t.untyped_storage().data_ptr() for t in inputs if t is not None and t.numel() > 0
    }
    for index, out in enumerate(outputs):
        assert out.dtype == dtype, f"{what} output {index}: dtype {out.dtype} != {dtype}"
        assert tuple(out.shape) == tuple(shape), (
            f"{what} output {index}: shape {tuple(out.shape)} != {tuple(shape)}"
        )
        assert out.is_contiguous(), f"{what} output {index} is not contiguous"
        if out.numel() > 0:
            assert out.untyped_storage().data_ptr() not in input_storages, (
                f"{what} output {index} aliases an input"
            )


# Broadcast forms of a modulation tensor (scale, shift, gate) against x = [B, S, D]:
#   "D"             [D] (one vector for every token)
#   "B1D"           [B, 1, D] contiguous (per sample)
#   "BSD"           [B, S, D] contiguous (per token)
#   "unbind6"       [B, 1, 6, D].unbind(2): [B, 1, D] views with row stride 6D (LTX-Video, Wan)
#   "chunk6"        [B, 6D].chunk(6, 1)[i][:, None]: [B, 1, D] views at offsets i*D (FLUX, SD3)
#   "token_unbind6" [B, S, 6, D].unbind(2): per-token [B, S, D] views with row stride 6D (LTX-2)
#   "frames"        [B, F, 1, D] against x.unflatten(1, (F, S // F)) (per-frame modulation)
BROADCASTS = ["D", "B1D", "BSD", "unbind6", "chunk6", "token_unbind6", "frames"]
FRAMES = 3


def make_modulation(kind, batch, seq, hidden, dtype, device, count, std=0.5):
    """`count` (<= 6) modulation tensors of the broadcast form `kind` (see BROADCASTS), values
    N(0, std^2). With kind "frames" the caller must view x as x.unflatten(1, (FRAMES, -1))."""

    def normal(*shape):
        return (std * torch.randn(*shape, device=device)).to(dtype)

    if kind == "D":
        return [normal(hidden) for _ in range(count)]
    if kind == "B1D":
        return [normal(batch, 1, hidden) for _ in range(count)]
    if kind == "BSD":
        return [normal(batch, seq, hidden) for _ in range(count)]
    if kind == "unbind6":
        return list(normal(batch, 1, 6, hidden).unbind(2))[:count]
    if kind == "chunk6":
        return [chunk[:, None] for chunk in normal(batch, 6 * hidden).chunk(6, dim=1)][:count]
    if kind == "token_unbind6":
        return list(normal(batch, seq, 6, hidden).unbind(2))[:count]
    if kind == "frames":
        assert seq % FRAMES == 0
        return [normal(batch, FRAMES, 1, hidden) for _ in range(count)]
    raise ValueError(kind)


def varied_rows(shape, dtype, device, layout="contiguous", offset=0.0):
    """An activation in a make_activation layout whose rows have scales from 0.4 to 8.4 (plus
    `offset`): rows of different magnitude catch per-row state mixed up between rows."""
    x = make_activation(shape, dtype, device, layout)
    row_scale = torch.rand(*shape[:-1], 1, device=device).mul(8).add(0.4)
    x.copy_(x.float() * row_scale + offset)  # in place: keeps the layout
    return x


def gelu_range(dtype, device) -> torch.Tensor:
    """One row of GELU inputs over every regime: the deep negative tail (cancellation in 1 + erf),
    around 0, large positive, subnormal inputs, signed zeros."""
    values = torch.cat(
        [
            torch.linspace(-12, 12, 4801),
            torch.tensor([0.0, -0.0, 1e-30, -1e-30]),
            torch.logspace(-7, 1, 200),
            -torch.logspace(-7, 1, 200),
        ]
    )
    return values.to(device).to(dtype).reshape(1, -1)
