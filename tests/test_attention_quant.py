"""The 8-bit operands of attention on CPU and CUDA: q through the "i8_row" format of the quantized
ops (qk_rmsnorm_rope_quant: per head in the norm and rotation's pass; quantize over rows of
head_dim for a q without them; the norm ops' *_quant forms take the format too), k through
quantize_attention_k (mean-smoothed INT8 per block of 128 keys) and v through quantize_attention_v
(e4m3 per channel, transposed). Each against reference's rule: the int8 and e4m3 codes and the
scales exact (the CUDA k mean, summed in fp32, within fp32 rounding of the C twin's double sum: its
codes within 1 and its scales within a few ulps), the dequantized values within half a step;
ties, zero and NaN blocks, odd sizes and head dims (the scalar kernels), strided and misaligned
views, lengths around the 128-key blocks and the 16-key padding, empty tensors, opcheck,
torch.compile without recompiles across sequence lengths, CUDA graphs, no backward, bad inputs."""

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference

from helpers import DTYPES, assert_compiles_once, assert_graph_replays_outputs
from test_rope import MODES, QK_TABLES, make_qk, norm_weight, tables_for

ATTENTION_QUANT_OPS = ("quantize_attention_k", "quantize_attention_v")
# [B, S, H, D]: one key, lengths around the 128-key blocks and the 16-key padding, head dims of the
# models (64, 128), an odd one (scalar kernels) and one of 8-element packs that is not a power of 2.
SHAPES = [(1, 1, 1, 64), (2, 130, 3, 64), (1, 255, 2, 128), (2, 77, 2, 40), (1, 129, 3, 37)]
# Sequence lengths of the models (GPU only): many 128-key blocks and reduction chunks per head.
GPU_SHAPES = [(2, 2688, 4, 64), (1, 4608, 3, 128), (1, 32760, 2, 128), (1, 49290, 1, 128)]
ZERO_I8_SCALE = (torch.tensor(reference.MIN_AMAX) / reference.I8_MAX).item()
ZERO_E4M3_SCALE = (torch.tensor(reference.MIN_AMAX) / reference.E4M3_MAX).item()


def make_heads(shape, dtype, device, layout="contiguous"):
    """A random [B, S, H, D] operand with an outlier channel (as k after RMSNorm and RoPE has) and
    a per-channel offset (what k's mean removes), in one of several layouts: contiguous; qkv (the k
    slice of a fused [B, S, 3, H, D] projection); transposed (a [B, H, S, D] tensor's transpose);
    misaligned (rows shifted by one element: no 16-byte alignment)."""
    b, s, h, d = shape
    full = {"qkv": (b, s, 3, h, d), "transposed": (b, h, s, d)}.get(layout, (b, s, h, d + 1))
    x = torch.randn(full, device=device)
    x[..., 0] *= 8  # an outlier channel
    x += torch.linspace(-2, 2, full[-1], device=device)  # a common offset
    x = x.to(dtype)
    if layout == "qkv":
        return x[:, :, 1]
    if layout == "transposed":
        return x.transpose(1, 2)
    return x[..., :d] if layout == "contiguous" else x[..., 1:]


def assert_equal_codes(got, want, what):
    """The same bytes (e4m3: any NaN code for a NaN)."""
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    if got.dtype == torch.float8_e4m3fn:
        differ &= ~(got.float().isnan() & want.float().isnan())
    assert not differ.any(), f"{what}: {differ.sum().item()} of {differ.numel()} codes differ"


def assert_equal_scales(got, want, what):
    assert got.dtype == torch.float32 and got.shape == want.shape, what
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=what)


# ------------------------------------------------------------------------------------------------
# q: the "i8_row" format
# ------------------------------------------------------------------------------------------------
def test_i8_rounding_of_every_code_and_tie(device):
    """Every code, the ties between neighbours (to even), points just off them and values beyond
    127, in one row of amax 127 (scale 1: the row is quantized as is)."""
    codes = torch.arange(-127, 128, dtype=torch.float32)
    mids = codes[:-1] + 0.5
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    row = torch.cat([codes, mids, up, down, torch.tensor([126.9, -126.7])])[None].to(device)
    q, q_scale = ltx_kernels.quantize(row, format="i8_row")
    assert q.dtype == torch.int8 and q_scale.item() == 1.0
    assert torch.equal(q.cpu(), row.cpu().round().to(torch.int8))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_q_per_head(device, dtype, shape):
    """q [B, S, H, D]: one scale per token and head, q ~ q8 * q_scale."""
    q = make_heads(shape, dtype, device, "qkv")
    q8, q_scale = ltx_kernels.quantize(q, format="i8_row")
    ref_q8, ref_scale = reference.quantize_rows(q, "i8_row")
    assert q8.shape == shape and q_scale.shape == shape[:3] and q8.is_contiguous()
    assert torch.equal(q8, ref_q8)
    assert_equal_scales(q_scale, ref_scale, "q_scale")
    error = (q8.double() * q_scale.double()[..., None] - q.double()).abs()
    assert (error <= (0.5 + 1e-4) * q_scale.double()[..., None]).all()  # (+ fp32 rounding)


def test_i8_zero_nan_and_huge_rows(device):
    x = torch.randn(4, 64, device=device)
    x[0] = 0
    x[1, 5] = float("nan")
    x[2] *= 1e30
    q, q_scale = ltx_kernels.quantize(x, format="i8_row")
    ref_q, ref_scale = reference.quantize_rows(x, "i8_row")
    assert q_scale[0].item() == ZERO_I8_SCALE and (q[0] == 0).all()
    assert torch.isnan(q_scale[1]) and (q[1] == 0).all()
    assert torch.equal(q, ref_q)
    assert_equal_scales(q_scale, ref_scale, "scales")


def assert_qk_quant(q, k, q_weight, k_weight, cos, sin, across_heads=True, interleaved=True):
    """qk_rmsnorm_rope_quant in both formats is exactly qk_rmsnorm_rope's q quantized per last-dim
    row (per head of a 4-D q) and qk_rmsnorm_rope's k."""
    args = (q, k, q_weight, k_weight, cos, sin, 1e-6, across_heads, interleaved)
    q_out, k_out = ltx_kernels.qk_rmsnorm_rope(*args)
    for format in ("i8_row", "e4m3_row"):
        q8, q_scale, k_got = ltx_kernels.qk_rmsnorm_rope_quant(*args, format=format)
        ref_q8, ref_scale = reference.quantize_rows(q_out, format)
        assert q8.shape == q.shape and q8.is_contiguous() and q_scale.shape == q.shape[:-1]
        assert_equal_codes(q8, ref_q8, f"q8 {format}")
        assert_equal_scales(q_scale, ref_scale, f"q_scale {format}")
        assert torch.equal(k_got, k_out)


@pytest.mark.parametrize("weight_kind", ["none", "fp32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["ltx", "wan", "flux", "flux_bhsd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_rmsnorm_rope_quant(device, dtype, kind, mode, weight_kind):
    q, k, across_heads = make_qk(kind, dtype, device, heads=4, head_dim=64)
    cos, sin = tables_for(QK_TABLES[kind], q.shape, mode, "fp32", dtype, device)
    size = q.shape[-1] * (q.shape[-2] if across_heads and q.dim() == 4 else 1)
    weight = norm_weight(weight_kind, size, dtype, device)
    assert_qk_quant(q, k, weight, weight, cos, sin, across_heads, MODES[mode][0])


@pytest.mark.parametrize("tables", ["1SD", "BSD"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_rmsnorm_rope_quant_ltx_split_into_heads(device, dtype, head_dim, tables):
    # LTX-Video's processor under attention="int8": q/k [B, S, C] and their tables ([1 or B, S,
    # C], rotation of adjacent pairs) split into heads [B, S, H, Dh], the norm across the heads:
    # the token-shaped call's values bit for bit, q quantized per token and head.
    heads = 3
    q, k, _ = make_qk("ltx", dtype, device, seq=37, heads=heads, head_dim=head_dim)
    cos, sin = tables_for(tables, q.shape, "pairs", "fp32", dtype, device)
    weight = norm_weight("fp32", heads * head_dim, dtype, device)
    q_tokens, k_tokens = ltx_kernels.qk_rmsnorm_rope(q, k, weight, weight, cos, sin, 1e-6, True)
    split = [t.unflatten(-1, (heads, head_dim)) for t in (q, k, cos, sin)]
    args = (*split[:2], weight, weight, *split[2:], 1e-6, True)
    q8, q_scale, k_heads = ltx_kernels.qk_rmsnorm_rope_quant(*args, format="i8_row")
    ref_q8, ref_scale = reference.quantize_rows(q_tokens.unflatten(-1, (heads, head_dim)), "i8_row")
    assert_equal_codes(q8, ref_q8, "q8")
    assert_equal_scales(q_scale, ref_scale, "q_scale")
    assert torch.equal(k_heads.flatten(2), k_tokens)
    assert torch.equal(ltx_kernels.qk_rmsnorm_rope(*args)[0].flatten(2), q_tokens)


# Heads x head_dim of the models (LTX 32x64, FLUX 24x128, Wan 40x128), a single head, and rows
# the cached kernel does not take (odd head_dim: scalar or streaming; 130 heads: too long).
@pytest.mark.parametrize(
    "heads,head_dim", [(32, 64), (24, 128), (40, 128), (1, 128), (3, 38), (130, 128)]
)
@pytest.mark.parametrize("across_heads", [True, False])
def test_qk_rmsnorm_rope_quant_head_sizes(device, heads, head_dim, across_heads):
    q, k, _ = make_qk("wan", torch.bfloat16, device, seq=5, heads=heads, head_dim=head_dim)
    cos, sin = tables_for("1S1Dh", q.shape, "halves", "fp32", torch.bfloat16, device)
    assert_qk_quant(q, k, None, None, cos, sin, across_heads, False)
    assert_qk_quant(q, k, None, None, None, None, across_heads)  # norm only


@pytest.mark.parametrize("layout", ["row_strided", "misaligned"])
def test_qk_rmsnorm_rope_quant_strided(device, layout):
    q, k, _ = make_qk("wan", torch.bfloat16, device, layout=layout)
    cos, sin = tables_for("1S1Dh", q.shape, "pairs", "fp32", torch.bfloat16, device)
    assert_qk_quant(q, k, None, None, cos, sin)


def test_qk_rmsnorm_rope_quant_zero_and_nan_heads(device):
    q, k, _ = make_qk("flux", torch.float32, device, seq=3, heads=3, head_dim=64)
    q[0, 0, 1] = 0  # a zero head (norm per head: zero stays zero)
    q[0, 1, 2, 5] = float("nan")
    q8, q_scale, _ = ltx_kernels.qk_rmsnorm_rope_quant(q, k, None, None, None, None, 1e-6, False)
    assert q_scale[0, 0, 1].item() == ZERO_I8_SCALE and (q8[0, 0, 1] == 0).all()
    assert torch.isnan(q_scale[0, 1, 2]) and (q8[0, 1, 2] == 0).all()
    assert_qk_quant(q, k, None, None, None, None, False)


def test_norm_quant_in_i8_row(device):
    """The norm ops' quantized forms take the format too (their value, quantized per row)."""
    x, mod = torch.randn(2, 9, 128, device=device), torch.randn(2, 1, 128, device=device)
    x, mod = x.to(torch.bfloat16), mod.to(torch.bfloat16)
    q, q_scale = ltx_kernels.rmsnorm_modulate_quant(x, mod, mod, format="i8_row")
    ref_q, ref_scale = reference.quantize_rows(ltx_kernels.rmsnorm_modulate(x, mod, mod), "i8_row")
    assert torch.equal(q, ref_q)
    assert_equal_scales(q_scale, ref_scale, "scales")


# ------------------------------------------------------------------------------------------------
# k: quantize_attention_k
# ------------------------------------------------------------------------------------------------
def assert_k_matches(k, k8, k_scale, exact):
    """(k8, k_scale) is reference.quantize_attention_k(k): exactly (the C twin's double mean), or
    with the CUDA fp32 mean (codes within 1, scales within 4 ulps); and it dequantizes to k - mean
    within half a step."""
    batch, kv_len, heads, head_dim = k.shape
    ref_k8, ref_scale = reference.quantize_attention_k(k)
    assert k8.dtype == torch.int8 and k8.shape == k.shape and k8.is_contiguous()
    assert k_scale.shape == (batch, heads, -(-kv_len // 128)) and k_scale.is_contiguous()
    if exact:
        assert torch.equal(k8, ref_k8), f"{(k8 != ref_k8).sum().item()} codes differ"
        assert_equal_scales(k_scale, ref_scale, "k_scale")
    else:
        assert (k8.int() - ref_k8.int()).abs().max().item() <= 1
        assert (k8 != ref_k8).float().mean().item() < 1e-3
        torch.testing.assert_close(k_scale, ref_scale, rtol=5e-7, atol=0)
    if kv_len and head_dim:
        mean = k.double().mean(1, keepdim=True)
        scale = k_scale.double().repeat_interleave(128, -1)[..., :kv_len].transpose(1, 2)[..., None]
        error = (k8.double() * scale - (k.double() - mean)).abs()
        assert (error <= (0.5 + 1e-4) * scale + 1e-6 * k.double().abs().amax()).all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_attention_k(device, dtype, shape):
    k = make_heads(shape, dtype, device)
    assert_k_matches(k, *ltx_kernels.quantize_attention_k(k), exact=device == "cpu")


@pytest.mark.parametrize("layout", ["qkv", "transposed", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_attention_k_strided(device, dtype, layout):
    k = make_heads((2, 200, 3, 64), dtype, device, layout)
    assert_k_matches(k, *ltx_kernels.quantize_attention_k(k), exact=device == "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_quantize_attention_k_model_lengths_cuda_vs_twin(shape):
    k = make_heads(shape, torch.bfloat16, "cuda")
    k8, k_scale = ltx_kernels.quantize_attention_k(k)
    cpu_k8, cpu_scale = ltx_kernels.quantize_attention_k(k.cpu())
    assert (k8.cpu().int() - cpu_k8.int()).abs().max().item() <= 1
    assert (k8.cpu() != cpu_k8).float().mean().item() < 1e-3
    torch.testing.assert_close(k_scale.cpu(), cpu_scale, rtol=5e-7, atol=0)


def test_quantize_attention_k_zero_and_nan_blocks(device):
    k = torch.randn(1, 300, 2, 64, device=device)
    k[:, :, 0] = 3.0  # head 0 constant: every centered value 0
    k[0, 140, 1, 7] = float("nan")  # head 1: NaN in block 1 (and in the mean)
    k8, k_scale = ltx_kernels.quantize_attention_k(k)
    ref_k8, ref_scale = reference.quantize_attention_k(k)
    assert (k_scale[0, 0] == ZERO_I8_SCALE).all() and (k8[:, :, 0] == 0).all()
    assert torch.isnan(k_scale[0, 1]).all() and (k8[:, :, 1] == 0).all()
    assert torch.equal(k8, ref_k8)
    assert_equal_scales(k_scale, ref_scale, "k_scale")


# ------------------------------------------------------------------------------------------------
# v: quantize_attention_v
# ------------------------------------------------------------------------------------------------
def assert_v_matches(v, v8, v_scale):
    """(v8, v_scale) is reference.quantize_attention_v(v) bit for bit, pad columns 0, and v8 *
    v_scale (its columns in key order, reference.v8_columns) is within half an e4m3 step of v."""
    batch, kv_len, heads, head_dim = v.shape
    kv_pad = -(-kv_len // 16) * 16
    ref_v8, ref_scale = reference.quantize_attention_v(v)
    assert v8.dtype == torch.float8_e4m3fn and v8.shape == (batch, heads, head_dim, kv_pad)
    assert v8.is_contiguous() and v_scale.shape == (batch, heads, head_dim)
    assert_equal_codes(v8, ref_v8, "v8")
    assert_equal_scales(v_scale, ref_scale, "v_scale")
    columns = reference.v8_columns(kv_pad, v8.device)  # (keys from kv_len on: pad columns)
    assert (v8.view(torch.uint8)[..., columns[kv_len:]] == 0).all()
    keys = reference.v8_keys(v8, kv_len)
    values = v.double().permute(0, 2, 3, 1)
    error = (keys.double() * v_scale.double()[..., None] - values).abs()
    bound = 2.0**-4 * values.abs() + 2.0**-10 * v_scale.double()[..., None]
    assert ((error <= bound) | v_scale.isnan()[..., None]).all()  # (NaN channels: NaN codes)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_attention_v(device, dtype, shape):
    v = make_heads(shape, dtype, device)
    assert_v_matches(v, *ltx_kernels.quantize_attention_v(v))


@pytest.mark.parametrize("layout", ["qkv", "transposed", "misaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantize_attention_v_strided(device, dtype, layout):
    v = make_heads((2, 200, 3, 64), dtype, device, layout)
    assert_v_matches(v, *ltx_kernels.quantize_attention_v(v))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_quantize_attention_v_model_lengths_cuda_vs_twin(shape):
    v = make_heads(shape, torch.bfloat16, "cuda")
    v8, v_scale = ltx_kernels.quantize_attention_v(v)
    cpu_v8, cpu_scale = ltx_kernels.quantize_attention_v(v.cpu())
    assert_equal_codes(v8.cpu(), cpu_v8, "v8")
    assert_equal_scales(v_scale.cpu(), cpu_scale, "v_scale")


def test_quantize_attention_v_zero_and_nan_channels(device):
    v = torch.randn(1, 40, 2, 64, device=device)
    v[:, :, 0, 3] = 0
    v[0, 17, 1, 5] = float("nan")
    v8, v_scale = ltx_kernels.quantize_attention_v(v)
    assert v_scale[0, 0, 3].item() == ZERO_E4M3_SCALE and (v8[0, 0, 3].float() == 0).all()
    assert torch.isnan(v_scale[0, 1, 5])
    assert_v_matches(v, v8, v_scale)


# ------------------------------------------------------------------------------------------------
# Both: empty tensors, custom-op contract, errors
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 5, 2, 64), (2, 0, 2, 64), (2, 5, 0, 64), (2, 5, 2, 0)])
@pytest.mark.parametrize("op", ATTENTION_QUANT_OPS)
def test_empty(device, op, shape):
    x = torch.randn(shape, device=device).to(torch.bfloat16)
    codes, scale = getattr(ltx_kernels, op)(x)
    ref_codes, ref_scale = getattr(reference, op)(x)
    assert codes.shape == ref_codes.shape and codes.dtype == ref_codes.dtype
    assert_equal_codes(codes, ref_codes, op)
    assert_equal_scales(scale, ref_scale, op)


def _args(device, seq=130):
    return (torch.randn(2, seq, 3, 64, device=device).to(torch.bfloat16),)


@pytest.mark.parametrize("op", ATTENTION_QUANT_OPS)
def test_opcheck(device, op):
    torch.library.opcheck(getattr(torch.ops.ltx_kernels, op), _args(device))


@pytest.mark.parametrize("op", ATTENTION_QUANT_OPS)
def test_compiles_once(device, op):
    # (lengths of several 128-key blocks: a single block's scale dim of size 1 is specialized)
    assert_compiles_once(getattr(ltx_kernels, op), lambda seq: _args(device, seq), (150, 291))


def test_q_format_compiles_once(device):
    assert_compiles_once(
        lambda q: ltx_kernels.quantize(q, format="i8_row"), lambda seq: _args(device, seq)
    )
    assert_compiles_once(
        lambda q: ltx_kernels.qk_rmsnorm_rope_quant(q, q, None, None, None, None),
        lambda seq: _args(device, seq),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("op", ATTENTION_QUANT_OPS)
def test_cuda_graph_capture(op):
    args = _args("cuda", 1000)
    assert_graph_replays_outputs(lambda: getattr(ltx_kernels, op)(*args))


@pytest.mark.parametrize("op", ATTENTION_QUANT_OPS)
def test_backward_raises_naming_the_op(device, op):
    x = _args(device)[0].requires_grad_()
    scale = getattr(ltx_kernels, op)(x)[1]
    with pytest.raises(RuntimeError, match=f"ltx_kernels.{op} has no backward"):
        scale.sum().backward()


def test_qk_rmsnorm_rope_quant_errors(device):
    q = torch.randn(2, 5, 3, 64, device=device)
    op = ltx_kernels.qk_rmsnorm_rope_quant
    with pytest.raises(RuntimeError, match="qk_rmsnorm_rope_quant: format must be 'e4m3_row' or"):
        op(q, q, None, None, None, None, format="int8")
    with pytest.raises(RuntimeError, match="qk_rmsnorm_rope_quant: q must be float32"):
        op(q.double(), q.double(), None, None, None, None)


@pytest.mark.parametrize("op", ATTENTION_QUANT_OPS)
def test_errors(device, op):
    name = op[-1]
    x = torch.randn(2, 5, 3, 64, device=device)
    with pytest.raises(RuntimeError, match=f"ltx_kernels.{op}: {name} must be 4-D"):
        getattr(ltx_kernels, op)(x[0])
    with pytest.raises(RuntimeError, match=f"ltx_kernels.{op}: {name} must be float32"):
        getattr(ltx_kernels, op)(x.double())
    with pytest.raises(RuntimeError, match=f"ltx_kernels.{op}: {name} must have a contiguous"):
        getattr(ltx_kernels, op)(x.transpose(2, 3))
    if device == "cuda":
        with pytest.raises(RuntimeError, match=f"ltx_kernels.{op}: head_dim .* at most 256"):
            getattr(ltx_kernels, op)(torch.randn(1, 5, 1, 264, device=device))
