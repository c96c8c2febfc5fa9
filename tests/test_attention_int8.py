"""ltx_kernels.attention_int8 (softmax attention over 8-bit operands: q8/k8 int8 with per-token and
per-128-key scales, v8 e4m3 transposed with per-channel scales) on the CPU (the C twin) and CUDA
(hopper_int8.cuh) against the float64 attention of the dequantized operands
(reference.attention_int8(..., compute_dtype=torch.float64, round_output=False): the exact value).

Tolerances, derived (notation of test_attention_op.py: eps = 2^-24, M_v = max |v|, E_s = |scale|
max |q_i| max |k_j| per batch element and head, of the dequantized operands):
- The C twin computes in double (the integer dot products exact, times the scales in double) and
  rounds once: float64 out within test_attention_op's float64 bound, other dtypes the correctly
  rounded exact value (helpers.assert_rounds_exact).
- The CUDA kernel, per output element, with r = 2^-4 + Sk 2^-10 / 448 + 2^-6:
    |out - exact| <= r (M_v + |exact|) / (1 - r) + M_v (2 ds + 3 Sk eps) + (u + 5 eps) |exact|
  The kernel computes out = sum_i p'_i v_i / sum_i p'_i: l is the row sum of the same rounded
  probabilities p' that multiply v, computed by the P V GEMM (a row of ones in V). r is the relative
  error of both sums: the numerator is within r M_v l of sum_i p_i v_i, and l' = l (1 + e), |e| <= r,
  so out' - exact = (e_N / l - exact e) / (1 + e). Its terms:
  * 2^-4: the probabilities, times 448, are rounded to e4m3 (3 mantissa bits: a relative error up
    to 2^-4) before both sums; Sk 2^-10 / 448: e4m3 subnormals (448 p < 2^-6) err by up to 2^-10
    absolutely, against l >= 448 (the max key's term is 448);
  * 2^-6: the FP8 tensor-core accumulation of one tile (128 keys; the kernel adds each tile into
    fp32 registers): its internal precision is not specified (DeepSeek-V3 measured about 14 bits
    on Hopper), counted as 2^-13 per addition over 128 keys;
  * ds = 4 eps E_s log2(e) + 2^-21: the integer scores are exact, their scaling by q_scale *
    k_scale * scale * log2(e) takes four fp32 roundings, ex2.approx 2 ulp;
  * 3 Sk eps M_v: the fp32 sums of the tiles; (u + 5 eps) |exact|: out's rounding, 1 / l, v_scale.
  and |lse - exact| <= 2 ds + 2 Sk eps + 2^-21 + 2 eps (|lse| + E_s log2(e)) + 2^-20 (ln 448)
  - ln(1 - r): lse is the log of the same l' (out and lse consistent: partial attentions merged by
  their lse give the whole one's out, which ring attention needs), so l's error is lse's. Work
  tiles split along their keys (test_split_work_tiles) round each part's probabilities against
  the part's own max, so r holds for each part's sums and for their merge, which adds its fp32
  error (test_attention_op.merge_error: 2 dm M_v and 4 eps |exact| to out, dm to lse).
  The bound is loose where a wrong index would hide (near-uniform weights average any permutation
  of keys), so two sharper checks stand beside it: with one key far above the others every
  probability is exactly 0 or 448, and out must be that key's v row exactly (any slip in the
  exchange of P's bytes between lanes, in the V tile's layout or across tiles shows); and random
  inputs keep a relative L2 error well under what an index slip gives (~1).

GPU tests carry the `gpu` mark (they skip without CUDA; the kernel needs an H100/H200):
  python3 -m pytest tests/test_attention_int8.py -q -m gpu
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
      tests/test_attention_int8.py -q -m gpu
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest \
      tests/test_attention_int8.py -q -m gpu -k "not large"
  compute-sanitizer --tool synccheck --error-exitcode 9 python3 -m pytest \
      tests/test_attention_int8.py -q -m gpu -k "not large"
"""

import functools
import math

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference
from ltx_kernels.reference import _dequantize_attention_int8, _quantize_attention_int8

from helpers import MANTISSA_BITS, assert_compiles_once, capture_graph
from test_attention_op import (
    assert_matches_exact,
    error_bounds,
    merge_error,
    split_after_whole_q_len,
)

EPS = 2.0**-24
LOG2E = 1 / math.log(2)
CPU_DTYPES = [torch.float64, torch.float32, torch.bfloat16]
CUDA_DTYPES = [torch.bfloat16, torch.float16]
# (q_len, kv_len): 1, below, at and past the 64-row and 128-key tiles
LENGTHS = [(1, 1), (1, 333), (63, 65), (65, 63), (127, 200), (200, 127), (333, 129), (129, 256)]


def dtypes_for(device):
    return CUDA_DTYPES if device == "cuda" else CPU_DTYPES


def make_operands(batch, q_len, kv_len, heads, head_dim, device, sharpness=1.0):
    """Random operands of the contract (quantized from random q, k, v with the test quantizer)."""
    q = torch.randn(batch, q_len, heads, head_dim, device=device) * sharpness
    k = torch.randn(batch, kv_len, heads, head_dim, device=device) + 0.5  # (a mean to smooth)
    v = torch.randn(batch, kv_len, heads, head_dim, device=device)
    return _quantize_attention_int8(q, k, v)


def cuda_bounds(operands, scale, exact, exact_lse):
    """|out - exact| and |lse - exact| bounds of the CUDA kernel (the module docstring)."""
    q, k, v = _dequantize_attention_int8(*operands)
    head_dim, kv_len = q.shape[-1], k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    e_s = abs(scale) * q.norm(dim=-1).amax(1) * k.norm(dim=-1).amax(1)  # [B, H]
    m_v = v.abs().amax(dim=(1, 3))
    ds = 4 * EPS * e_s * LOG2E + 2.0**-21
    r = 2.0**-4 + kv_len * 2.0**-10 / 448 + 2.0**-6  # P's rounding, subnormals, FP8 accumulation
    sums = r / (1 - r)
    dm = merge_error(e_s, kv_len, l_max=448.0)  # (split work tiles)
    per_head = m_v * (sums + 2 * ds + 3 * kv_len * EPS + 2 * dm)
    out_bound = per_head[:, None, :, None] + (sums + 2.0**-8 + 9 * EPS) * exact.abs()
    lse_bound = (2 * ds + 2 * kv_len * EPS + 2.0**-21 + 2.0**-20 - math.log1p(-r) + dm)[
        :, :, None
    ] + 2 * EPS * (exact_lse.abs() + (e_s * LOG2E)[:, :, None])
    return out_bound, lse_bound


def relative_l2(got, exact):
    return ((got.double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()


def check(operands, key_lengths=None, scale=None, out_dtype=torch.bfloat16, what=""):
    """ltx_kernels.attention_int8 against the exact value: out and lse, shapes, dtypes, layout."""
    out, lse = ltx_kernels.attention_int8(
        *operands, key_lengths, scale, out_dtype=out_dtype, return_lse=True
    )
    exact, exact_lse = reference.attention_int8(
        *operands,
        key_lengths,
        scale,
        return_lse=True,
        compute_dtype=torch.float64,
        round_output=False,
    )
    q8 = operands[0]
    batch, q_len, heads, _ = q8.shape
    assert out.shape == q8.shape and out.dtype == out_dtype and out.is_contiguous(), what
    lse_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    assert lse.shape == (batch, heads, q_len) and lse.dtype == lse_dtype, what
    if out.numel() == 0:
        return out, lse
    bounds = None  # (the C twin in fp32/bf16: the correctly rounded exact value)
    if q8.is_cuda:
        bounds = functools.partial(cuda_bounds, operands, scale, exact, exact_lse)
    elif out_dtype == torch.float64:
        double = {"u": 2.0**-53, "eps": 2.0**-53, "exp_error": 2.0**-52}
        q, k, v = _dequantize_attention_int8(*operands)
        bounds = functools.partial(error_bounds, q, k, v, scale, exact, exact_lse, **double)
    attended = assert_matches_exact(out, lse, exact, exact_lse, bounds, what)
    if attended and q8.is_cuda:
        assert relative_l2(out, exact) < 0.05, f"{what}: relative L2 {relative_l2(out, exact)}"
    return out, lse


# ------------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
def test_matches_exact(device, head_dim, q_len, kv_len):
    operands = make_operands(2, q_len, kv_len, 3, head_dim, device)
    for dtype in dtypes_for(device):
        check(operands, out_dtype=dtype, what=f"{dtype} {q_len}x{kv_len} hd{head_dim}")


@pytest.mark.parametrize("sharpness", [0.0, 4.0, 16.0])
def test_flat_and_peaked_softmax(device, sharpness):
    operands = make_operands(2, 100, 300, 2, 128, device, sharpness)
    check(operands, out_dtype=dtypes_for(device)[0], what=f"sharpness {sharpness}")


@pytest.mark.parametrize("scale", [1.0, 0.01, -0.2])
def test_explicit_scale(device, scale):
    # several tiles at both head dims: a negative scale takes the min of the integer scores
    for head_dim in (64, 128):
        operands = make_operands(1, 130, 300, 2, head_dim, device)
        check(operands, scale=scale, out_dtype=dtypes_for(device)[0], what=f"scale {scale}")


@pytest.mark.parametrize("head_dim", [1, 8, 40, 96, 200])
def test_cpu_twin_takes_any_head_dim(head_dim):
    operands = make_operands(2, 9, 140, 2, head_dim, "cpu")
    check(operands, out_dtype=torch.float64, what=f"hd{head_dim}")


@pytest.mark.parametrize("batch,heads", [(1, 1), (1, 7), (5, 1), (3, 5)])
def test_batch_and_heads(device, batch, heads):
    operands = make_operands(batch, 70, 150, heads, 64, device)
    check(operands, out_dtype=dtypes_for(device)[0], what=f"{batch}x{heads}")


def one_key_operands(batch, q_len, kv_len, heads, head_dim, device, key_lengths=None):
    """Operands where query (b, i, h) attends one key j(b, i, h) < n_b: k8 entries are +-127, so
    every key has the same norm and q8 = k8[j] scores key j above any other by >= 2 / head_dim of
    its score, which the scales set near 2^12 in base 2: every other probability is 0 in e4m3
    (448 * 2^-64) and below double's resolution (2^-64), while the fp32 max subtraction at 2^12
    errs by at most 2^-12 (the CUDA check's tolerance, one ulp of out, covers it).
    Returns (operands, j)."""
    k8 = (torch.randint(0, 2, (batch, kv_len, heads, head_dim), device=device) * 254 - 127).to(
        torch.int8
    )
    n = torch.full((batch,), kv_len) if key_lengths is None else key_lengths.cpu().clamp(0, kv_len)
    j = (torch.rand(batch, q_len, heads) * n.clamp_min(1)[:, None, None]).long().to(device)
    q8 = torch.gather(k8, 1, j[..., None].expand(-1, -1, -1, head_dim))
    typical = math.sqrt(2**12 / (head_dim * 127**2 * head_dim**-0.5 * LOG2E))
    q_scale = typical * (0.9 + 0.2 * torch.rand(batch, q_len, heads, device=device))
    k_scale = typical * (0.9 + 0.2 * torch.rand(batch, heads, -(-kv_len // 128), device=device))
    padded = -(-kv_len // 16) * 16
    v8 = torch.randn(batch, heads, head_dim, padded, device=device).to(torch.float8_e4m3fn)
    v_scale = torch.rand(batch, heads, head_dim, device=device) + 0.5
    return (q8, q_scale, k8, k_scale, v8, v_scale), j


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (65, 63), (127, 200), (200, 333)])
def test_each_query_attends_one_key(device, head_dim, q_len, kv_len):
    lengths = torch.tensor([kv_len, max(kv_len // 2, 1)], device=device)
    operands, j = one_key_operands(2, q_len, kv_len, 3, head_dim, device, lengths)
    q8, q_scale, k8, k_scale, v8, v_scale = operands
    keys = reference.v8_keys(v8, kv_len)
    v = (keys.double() * v_scale.double()[..., None]).permute(0, 3, 1, 2)  # [B, Sk, H, D]
    expected = torch.gather(v, 1, j[..., None].expand(-1, -1, -1, head_dim))
    scale = head_dim**-0.5
    block_scale = torch.gather(k_scale.transpose(1, 2), 1, j // 128).double()  # [B, Sq, H]
    expected_lse = (q_scale.double() * block_scale * scale * head_dim * 127**2).transpose(1, 2)
    for dtype in dtypes_for(device):
        out, lse = ltx_kernels.attention_int8(*operands, lengths, out_dtype=dtype, return_lse=True)
        # CPU: the correctly rounded v row (bit for bit); CUDA: within one ulp of out's dtype
        rtol = 2.0 ** -MANTISSA_BITS[dtype] if device == "cuda" else 0.0
        torch.testing.assert_close(
            out.double(), expected.to(dtype).double(), rtol=rtol, atol=0, msg=f"{dtype}"
        )
        torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------
# Key lengths
# ------------------------------------------------------------------------------------------------
KEY_LENGTHS = {
    "zero": [0, 0],
    "one": [1, 1],
    "partial": [37, 100],
    "full": [130, 130],
    "mixed": [0, 1, 64, 65, 129, 130],
    "clamped": [-5, 1000],
}


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", KEY_LENGTHS)
def test_key_lengths(device, case, index_dtype):
    lengths = KEY_LENGTHS[case]
    for head_dim in (64, 128):
        operands = make_operands(len(lengths), 70, 130, 2, head_dim, device)
        key_lengths = torch.tensor(lengths, dtype=index_dtype, device=device)
        dtype = dtypes_for(device)[0]
        out, lse = check(operands, key_lengths, out_dtype=dtype, what=f"{case} hd{head_dim}")
        # the keys past each length are not read: other codes there (NaN in v8's columns of
        # those keys and its pad columns) change nothing
        q8, q_scale, k8, k_scale, v8, v_scale = operands
        k8, v8 = k8.clone(), v8.clone()
        columns = reference.v8_columns(v8.shape[3], device)  # (pad columns as keys past kv_len)
        for b, n in enumerate(lengths):
            k8[b, max(n, 0) :] = 127
            v8.view(torch.uint8)[b, :, :, columns[max(n, 0) :]] = 0x7F  # e4m3 NaN
        again = ltx_kernels.attention_int8(
            q8, q_scale, k8, k_scale, v8, v_scale, key_lengths, out_dtype=dtype, return_lse=True
        )
        assert torch.equal(again[0], out) and torch.equal(again[1], lse), case


def test_zero_length_gives_zeros_and_minus_inf(device):
    operands = make_operands(2, 5, 9, 3, 64, device)
    out, lse = ltx_kernels.attention_int8(
        *operands, torch.tensor([0, 9], device=device), return_lse=True
    )
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------
def test_strided_views(device):
    # q8 and k8 slices of one [B, S, 2, H, D] buffer (a fused quantizer's output), v8 a view of a
    # wider [B, H, D, Sk_pad + 32] buffer: read in place, the same result as contiguous copies.
    batch, seq, heads, head_dim = 2, 150, 3, 64
    q8, q_scale, k8, k_scale, v8, v_scale = make_operands(batch, seq, seq, heads, head_dim, device)
    qk = torch.stack([q8, k8], dim=2)
    q8_view, k8_view = qk.unbind(2)
    wide = torch.zeros(*v8.shape[:3], v8.shape[3] + 32, device=device, dtype=torch.uint8)
    wide[..., : v8.shape[3]] = v8.view(torch.uint8)
    v8_view = wide.view(torch.float8_e4m3fn)[..., : v8.shape[3]]
    assert not (q8_view.is_contiguous() or k8_view.is_contiguous() or v8_view.is_contiguous())
    strided = (q8_view, q_scale, k8_view, k_scale, v8_view, v_scale)
    out = check(strided, out_dtype=dtypes_for(device)[0], what="strided")[0]
    contiguous = (q8, q_scale, k8, k_scale, v8, v_scale)
    dtype = dtypes_for(device)[0]
    assert torch.equal(out, ltx_kernels.attention_int8(*contiguous, out_dtype=dtype))


def test_v8_column_order():
    # key 16 g + 8 h + 2 t + e at column 16 g + 4 t + 2 h + e (ltx_attention_v_column): the order a
    # Hopper consumer's score accumulators hold a group's keys in (hopper_int8.cuh); the kernel,
    # the C twin and quantize_attention_v read and write it (test_each_query_attends_one_key).
    group = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    expected = group + [16 + c for c in group] + [32 + c for c in group[:5]]
    assert reference.v8_columns(37).tolist() == expected
    assert sorted(reference.v8_columns(48).tolist()) == list(range(48))


@pytest.mark.parametrize(
    "shape",
    [(0, 5, 2, 64, 7), (2, 0, 2, 64, 7), (2, 5, 0, 64, 7), (2, 5, 2, 64, 0), (0, 0, 0, 64, 0)],
    ids=["batch", "q_len", "heads", "kv_len", "all"],
)
def test_empty(device, shape):
    batch, q_len, heads, head_dim, kv_len = shape
    operands = make_operands(batch, q_len, kv_len, heads, head_dim, device)
    out, lse = check(operands, out_dtype=dtypes_for(device)[0], what=f"empty {shape}")
    if kv_len == 0 and out.numel():  # no keys: zeros, lse -inf
        assert (out == 0).all() and torch.isneginf(lse).all()


def test_lse_only_when_asked(device):
    operands = make_operands(1, 3, 4, 2, 64, device)
    out = ltx_kernels.attention_int8(*operands)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 3, 2, 64)
    assert out.dtype == torch.bfloat16
    out2, lse = ltx_kernels.attention_int8(*operands, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 3)


# ------------------------------------------------------------------------------------------------
# torch integration
# ------------------------------------------------------------------------------------------------
def test_opcheck(device):
    operands = make_operands(2, 9, 13, 2, 64, device)
    lengths = torch.tensor([13, 5], dtype=torch.int32, device=device)
    op = torch.ops.ltx_kernels.attention_int8.default
    # (not test_schema: its mutation check multiplies the inputs, which float8 v8 does not take)
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, operands, {"return_lse": True}, test_utils=tests)
    torch.library.opcheck(
        op, (*operands, lengths, 0.3), {"out_dtype": torch.float16}, test_utils=tests
    )


def test_torch_compile_fullgraph_dynamic(device):
    lengths = torch.tensor([3, 40], device=device)

    def fn(*operands):
        out, lse = ltx_kernels.attention_int8(*operands, lengths, return_lse=True)
        return out * 2, lse

    # (k_scale's ceil(Sk / 128) stays >= 2: a size of 1 would be specialized)
    assert_compiles_once(
        fn, lambda seq: make_operands(2, seq, seq + 5, 2, 64, device), lengths=(300, 400, 500)
    )


def test_no_backward(device):
    q8, q_scale, k8, k_scale, v8, v_scale = make_operands(1, 4, 6, 2, 64, device)
    q_scale.requires_grad_(True)
    out = ltx_kernels.attention_int8(q8, q_scale, k8, k_scale, v8, v_scale)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"ltx_kernels\.attention_int8 has no backward yet"):
        out.sum().backward()


def _bad_inputs(device):
    """(arguments, keyword arguments, message) of calls that must raise naming the argument."""
    ok = make_operands(2, 5, 7, 3, 64, device)
    q8, q_scale, k8, k_scale, v8, v_scale = ok

    def with_(i, t):
        return tuple(t if n == i else a for n, a in enumerate(ok))

    return [
        (with_(0, q8.float()), {}, "q8 must be int8"),
        (with_(0, q8[0]), {}, "q8 must be 4-D"),
        (with_(2, k8[:, :, :2]), {}, "k8 must have q8's batch, heads and head_dim"),
        (with_(4, v8.view(torch.int8)), {}, "v8 must be float8_e4m3fn"),
        (with_(4, v8[..., :3]), {}, r"v8 must have shape \[batch, heads, head_dim, kv_len_padded"),
        # (as many columns as keys, but a group's keys may lie up to kv_len rounded up to 16)
        (with_(4, v8[..., :7]), {}, r"v8 must have shape .* >= 16\]"),
        (with_(1, q_scale.double()), {}, "q_scale must be float32"),
        (with_(1, q_scale[:, :2]), {}, r"q_scale must have shape \[batch, seq_len, heads\]"),
        (with_(3, k_scale.expand(2, 3, 2)), {}, r"k_scale must have shape \[batch, heads, ceil"),
        (with_(5, v_scale.transpose(0, 1)), {}, "v_scale must have shape"),
        (with_(5, v_scale.mT.contiguous().mT), {}, "v_scale must be contiguous"),
        ((*ok, torch.tensor([1.0, 2.0], device=device)), {}, "key_lengths must be int32 or int64"),
        ((*ok, None, float("nan")), {}, "scale must be finite"),
        (ok, {"out_dtype": torch.int32}, "out_dtype must be"),
    ]


@pytest.mark.parametrize("case", range(14))
def test_bad_inputs_raise_naming_the_argument(device, case):
    args, kwargs, message = _bad_inputs(device)[case]
    with pytest.raises(RuntimeError, match=rf"ltx_kernels\.attention_int8: {message}"):
        ltx_kernels.attention_int8(*args, **kwargs)


def test_the_fake_checks_shapes():
    q8, q_scale, k8, k_scale, v8, v_scale = make_operands(2, 5, 7, 3, 64, "meta")
    out, lse = ltx_kernels.attention_int8(q8, q_scale, k8, k_scale, v8, v_scale, return_lse=True)
    assert out.shape == (2, 5, 3, 64) and out.dtype == torch.bfloat16 and lse.shape == (2, 3, 5)
    with pytest.raises(RuntimeError, match="k_scale must have"):
        ltx_kernels.attention_int8(q8, q_scale, k8, k_scale[:, :, :0], v8, v_scale)
    with pytest.raises(RuntimeError, match=r"v8.shape\[3\] must be >= Sk rounded up to 16"):
        ltx_kernels.attention_int8(q8, q_scale, k8, k_scale, v8[..., :7], v_scale)
    # the real op's dtype rules too (under torch.compile a wrong dtype fails at trace time)
    a = torch.ops.ltx_kernels.attention_int8
    with pytest.raises(RuntimeError, match="v8 must be one of"):
        a(q8, q_scale, k8, k_scale, v8.view(torch.int8), v_scale)
    with pytest.raises(RuntimeError, match="q_scale must be one of"):
        a(q8, q_scale.bfloat16(), k8, k_scale, v8, v_scale)
    with pytest.raises(RuntimeError, match="out_dtype must be one of"):
        a(q8, q_scale, k8, k_scale, v8, v_scale, out_dtype=torch.int32)
    with pytest.raises(RuntimeError, match="quantize_attention_k: its input must be one of"):
        torch.ops.ltx_kernels.quantize_attention_k(torch.empty(2, 5, 3, 64, device="meta").double())


# ------------------------------------------------------------------------------------------------
# Accuracy of the whole 8-bit path on realistic q/k: RMSNorm'd, RoPE'd, a few outlier channels
# ------------------------------------------------------------------------------------------------
def realistic_qkv(batch, seq, heads, head_dim, device, outliers=4, seed=0, v_mean=0.0):
    """bf16 q, k, v as a video DiT's attention sees them: q and k RMS-normalized per head with a
    learned-like weight that makes `outliers` channels 8x larger, then rotated by a 1-D RoPE; k
    with a per-head bias (the mean K smoothing removes); v normal, plus per channel an offset of
    standard deviation v_mean (as a projection's bias gives)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=g)

    weight = 1 + 0.1 * normal(heads, head_dim)
    weight[:, torch.randperm(head_dim, generator=g)[:outliers]] *= 8
    q = reference.rmsnorm(normal(batch, seq, heads, head_dim), None) * weight
    k = reference.rmsnorm(normal(batch, seq, heads, head_dim) + 0.5, None) * weight
    position = torch.arange(seq, dtype=torch.float64)[:, None]
    freqs = 10000 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = (position * freqs).float()  # [S, D / 2]
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]

    def rope(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)

    v = normal(batch, seq, heads, head_dim) + v_mean * normal(heads, head_dim)
    return tuple(t.to(device, torch.bfloat16) for t in (rope(q), rope(k), v))


@pytest.mark.parametrize("v_mean", [0.0, 1.0])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_accuracy_on_realistic_qk(device, head_dim, v_mean):
    # Against bf16 attention of the unquantized q, k, v (ltx_kernels.attention): per head cosine
    # similarity and relative L2 (printed: pytest -s). This data is deliberately hard: 8x outlier
    # channels in q and k make the softmax sharp (score std ~10, ~3 keys effectively attended) and
    # set the int8 steps of every other channel. Measured on the CPU (the exact attention of the
    # dequantized operands, i.e. the quantization alone): cosine 0.9989-0.9991, relative L2
    # 0.041-0.047, mostly K's per-block int8 and V's e4m3; emulating the kernel's e4m3 P adds
    # < 0.001 to the relative L2. The thresholds leave room above those. v_mean: V's channels with
    # offsets (the output's norm grows by them, the error less: a smaller relative L2).
    seq = 1000 if device == "cpu" else 4600
    q, k, v = realistic_qkv(1, seq, 4, head_dim, device, v_mean=v_mean)
    bf16 = ltx_kernels.attention(q, k, v).double()
    int8 = ltx_kernels.attention_int8(*_quantize_attention_int8(q, k, v)).double()
    for h in range(q.shape[2]):
        a, b = int8[:, :, h].flatten(), bf16[:, :, h].flatten()
        cosine = (torch.dot(a, b) / (a.norm() * b.norm())).item()
        rel_l2 = ((a - b).norm() / b.norm()).item()
        print(
            f"{device} hd{head_dim} v_mean {v_mean} head {h}: cosine {cosine:.6f}, rel L2 {rel_l2:.4f}"
        )
        assert cosine > 0.998 and rel_l2 < 0.06, (h, cosine, rel_l2)


# ------------------------------------------------------------------------------------------------
# CUDA only: graphs, streams, the models' lengths
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_limits_raise():
    operands = make_operands(1, 5, 7, 2, 96, "cuda")
    with pytest.raises(RuntimeError, match="head_dim .* must be 64 or 128 on CUDA"):
        ltx_kernels.attention_int8(*operands)
    operands = make_operands(1, 5, 7, 2, 64, "cuda")
    with pytest.raises(RuntimeError, match="out_dtype must be bfloat16 or float16 on CUDA"):
        ltx_kernels.attention_int8(*operands, out_dtype=torch.float32)
    q8, q_scale, k8, k_scale, v8, v_scale = operands
    unaligned = torch.zeros(1, 5, 2, 65, dtype=torch.int8, device="cuda")[..., 1:]
    with pytest.raises(RuntimeError, match="q8's rows must start at 16-byte boundaries"):
        ltx_kernels.attention_int8(unaligned, q_scale, k8, k_scale, v8, v_scale)
    # v8 rows 17 bytes apart: 16 columns each (7 keys rounded up), not at 16-byte boundaries
    unaligned_v8 = torch.zeros(1, 2, 64, 17, dtype=torch.float8_e4m3fn, device="cuda")[..., :16]
    with pytest.raises(RuntimeError, match="v8's rows must start at 16-byte boundaries"):
        ltx_kernels.attention_int8(q8, q_scale, k8, k_scale, unaligned_v8, v_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [150, 700])  # (700: work tiles split, merged by a second kernel)
def test_cuda_graph_capture(kv_len):
    operands = make_operands(2, 100, kv_len, 2, 128, "cuda")
    lengths = torch.tensor([kv_len, 70], device="cuda")
    graph, (out, lse) = capture_graph(
        lambda: ltx_kernels.attention_int8(*operands, lengths, return_lse=True)
    )
    operands[0].copy_(torch.randint_like(operands[0], -127, 128))
    lengths.copy_(torch.tensor([20, kv_len - 1]))
    graph.replay()
    expected, expected_lse = ltx_kernels.attention_int8(*operands, lengths, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    operands = make_operands(1, 200, 300, 4, 64, "cuda")
    expected = ltx_kernels.attention_int8(*operands)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = ltx_kernels.attention_int8(*operands)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_writes_every_output_element():
    # out comes from torch.empty: poison the caching allocator's block first
    operands = make_operands(2, 333, 129, 3, 128, "cuda")
    torch.full((2, 333, 3, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = ltx_kernels.attention_int8(*operands)
    assert torch.isfinite(out).all()


# Key lengths of a batch whose work tiles outnumber the SMs several times over: each persistent
# CTA runs work tiles of several lengths in a row (none, one key, partial tiles with a zeroed V
# tail, whole ones), its K/V ring, Q tiles and turns going on across them.
PERSISTENT_LENGTHS = [0, 1, 64, 65, 129, 130, 0, 200, 77, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_work_tiles_of_several_lengths_per_cta(head_dim):
    batch, q_len, heads = len(PERSISTENT_LENGTHS), 600, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert math.ceil(q_len / 192) * heads * batch > 4 * sms
    operands = make_operands(batch, q_len, 256, heads, head_dim, "cuda")
    key_lengths = torch.tensor(PERSISTENT_LENGTHS, device="cuda")
    check(operands, key_lengths, what=f"hd{head_dim}")


# Work tiles split along their keys (test_attention_op.test_split_work_tiles' cases).
SPLIT_LENGTHS = [0, 1, 129, 300, 700, 1100]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_work_tiles(head_dim, monkeypatch):
    operands = make_operands(len(SPLIT_LENGTHS), 333, 1100, 3, head_dim, "cuda")
    key_lengths = torch.tensor(SPLIT_LENGTHS, device="cuda")
    outs = {}
    for split in ("auto", "off"):
        monkeypatch.setenv("LTX_KERNELS_ATTENTION_SPLIT", split)
        for out_dtype in CUDA_DTYPES:
            what = f"split {split} {out_dtype} hd{head_dim}"
            out, lse = check(operands, key_lengths, out_dtype=out_dtype, what=what)
            again = ltx_kernels.attention_int8(
                *operands, key_lengths, out_dtype=out_dtype, return_lse=True
            )
            assert torch.equal(again[0], out) and torch.equal(again[1], lse), what
            outs[split, out_dtype] = out
        outs[split, "all keys"] = check(operands, what=f"split {split} all keys")[0]
    for key in CUDA_DTYPES + ["all keys"]:
        assert not torch.equal(outs["auto", key], outs["off", key]), f"hd{head_dim}: no split"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_after_whole_tiles(head_dim, monkeypatch):
    # (test_attention_op.test_split_after_whole_tiles' case: whole work tiles before a split one's)
    lengths = [0, 1, 300, 700, 1100]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q_len = split_after_whole_q_len(sms, len(lengths))
    operands = make_operands(len(lengths), q_len, 1100, 1, head_dim, "cuda")
    key_lengths = torch.tensor(lengths, device="cuda")
    outs = {}
    for split in ("auto", "off"):
        monkeypatch.setenv("LTX_KERNELS_ATTENTION_SPLIT", split)
        outs[split] = check(operands, key_lengths, what=f"split {split} hd{head_dim}")[0]
    assert not torch.equal(outs["auto"], outs["off"]), f"hd{head_dim}: no split"


# analogs of the models' lengths (2688, 32760, 49290: not multiples of 128), batch and heads
LARGE = [(1, 2688, 2, 64), (1, 8064, 1, 64), (1, 32760, 1, 128), (1, 49290, 1, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LARGE, ids=lambda c: "x".join(map(str, c)))
def test_large(case):
    batch, seq, heads, head_dim = case
    operands = make_operands(batch, 256, seq, heads, head_dim, "cuda")  # 256 queries: the exact
    check(operands, what=f"large {case}")  # reference is [Sq, Sk] per head
