"""ltx_kernels.attention (non-causal softmax attention, [B, S, H, D]) on the CPU (the C twin) and
CUDA (the tensor-core kernel) against the float64 evaluation of its formula
(reference.attention(..., compute_dtype=torch.float64, round_output=False): the exact value).

Tolerances, derived (T the dtype, u its unit roundoff: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32;
eps = 2^-24; per batch element and head M_v = max |v|, E_s = scale * max |q_i| * max |k_j| >=
scale * sum_d |q_id k_jd| (Cauchy-Schwarz), D = head_dim, Sk = the keys):
- The C twin computes in double and rounds once (via fp32) to T: out is the correctly rounded exact
  value (helpers.assert_rounds_exact: half an ulp plus fp32's slop, 99% bit-exact for fp16/bf16),
  lse (fp32) too; in float64, the bound below with u = eps = 2^-53 (double sums and exp).
- The CUDA kernel, per output element:
    |out - exact| <= M_v (u + 2 ds + 3 Sk eps [+ Sk 2^-25 for fp16]) + (u + 4 eps) |exact|
  * u M_v: the probabilities p_j are rounded to T before p.v: sum_j p_j d_j v_j / sum_j p_j with
    |d_j| <= u is at most u M_v (the sum l is of the unrounded p);
  * 2 ds M_v: each score's error ds = (2 D + 4) eps E_s log2(e) + 2^-21 (q.k accumulated in fp32
    on tensor cores over D products, counted as two roundings per addition since the tensor core's
    internal rounding is not specified; the scale, base-2 and max subtraction roundings; exp2f's
    2 ulp) perturbs each p relatively by ds, the normalized weights by at most 2 ds;
  * 3 Sk eps M_v: the fp32 sums of p.v and of l over Sk keys, and the tile rescalings;
  * Sk 2^-25 M_v (fp16 only): probabilities below 2^-14 are fp16 subnormals, rounded with an
    absolute error up to 2^-25 instead of a relative one;
  * (u + 4 eps) |exact|: the final rounding to T and the fp32 division by l.
  and |lse - exact| <= 2 ds + 2 Sk eps + 2 eps (|lse| + E_s log2(e)) + 2^-21. A work tile split
  along its keys (test_split_work_tiles) is each part's attention merged by the parts' lse: the
  bound gains the merge's fp32 error (merge_error), a few eps E_s.
  At head_dim 64 the Hopper body's l is the row sum of the rounded probabilities p', computed by
  the P V GEMM (a ones column beside V): out = sum_j p'_j v_j / sum_j p'_j. With r = u [+ Sk
  2^-25 for fp16], now the relative error of both sums (numerator within r M_v l, l' = l (1 + e),
  |e| <= r), out' - exact = (e_N / l - exact e) / (1 + e): the u M_v and Sk 2^-25 M_v terms become
  r (M_v + |exact|) / (1 - r), and lse gains -ln(1 - r) (l's own error; out and lse stay
  consistent). The bound at head_dim 64 on CUDA is that one (it covers the mma body's too).
  These are worst-case bounds; the one-key test below has no tolerance at all: with one score far
  above the others every probability is exactly 0 or 1, so out must be that key's v row bit for
  bit (any indexing slip across tiles, heads or batch elements shows), and lse its score.

GPU tests carry the `gpu` mark (they skip without CUDA). The CUDA launcher has two kernel bodies
(attention.cu): on an H100/H200 the Hopper one (hopper_wgmma.cuh) unless a call's operands need
the portable one (flash_mma.cuh); LTX_KERNELS_ATTENTION_KERNEL=mma or =wgmma pins one, so the
GPU tests run over each body with
  LTX_KERNELS_ATTENTION_KERNEL=mma python3 -m pytest tests/test_attention_op.py -q -m gpu
  LTX_KERNELS_ATTENTION_KERNEL=wgmma python3 -m pytest tests/test_attention_op.py -q -m gpu
and test_kernel_bodies runs both in one process. compute-sanitizer on a GPU machine (also
in benchmarks/run_on_device.sh's SANITIZE=1 subset, without the large cases):
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/test_attention_op.py \
      -q -m gpu
  compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest tests/test_attention_op.py \
      -q -m gpu -k "not large"
"""

import functools
import math

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference

from helpers import MANTISSA_BITS, assert_compiles_once, assert_rounds_exact, capture_graph

EPS = 2.0**-24
LOG2E = 1 / math.log(2)
CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CUDA_DTYPES = [torch.bfloat16, torch.float16]
# (q_len, kv_len): 1, below, at and past the 64-row tiles, and analogs of the models' lengths
LENGTHS = [(1, 1), (1, 333), (63, 65), (65, 63), (127, 200), (200, 127), (333, 129)]


def dtypes_for(device):
    return CUDA_DTYPES if device == "cuda" else CPU_DTYPES


def make_qkv(batch, q_len, kv_len, heads, head_dim, dtype, device, sharpness=1.0):
    """Random q [B, Sq, H, D], k and v [B, Sk, H, D]; sharpness scales q (peaked softmax)."""
    q = (torch.randn(batch, q_len, heads, head_dim, device=device) * sharpness).to(dtype)
    k = torch.randn(batch, kv_len, heads, head_dim, device=device).to(dtype)
    v = torch.randn(batch, kv_len, heads, head_dim, device=device).to(dtype)
    return q, k, v


def _per_head(x):
    """[B, H] -> broadcastable against [B, S, H, D]."""
    return x[:, None, :, None]


def error_bounds(
    q,
    k,
    v,
    scale,
    exact,
    exact_lse,
    u=None,
    eps=EPS,
    exp_error=2.0**-21,
    gemm_sums=False,
    merge=False,
):
    """Bounds of |out - exact| and |lse - exact_lse| (the module docstring): the CUDA kernel's
    (u: q.dtype's unit roundoff, fp32 sums; gemm_sums: l of the rounded probabilities, as the
    Hopper body at head_dim 64; merge: work tiles split along their keys may be merged), or with
    u = eps = 2^-53 and no exp error the C twin's float64 form (double sums; the same
    derivation)."""
    u = 2.0 ** -(MANTISSA_BITS[q.dtype] + 1) if u is None else u
    head_dim, kv_len = q.shape[-1], k.shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    e_s = abs(scale) * q.double().norm(dim=-1).amax(1) * k.double().norm(dim=-1).amax(1)  # [B, H]
    m_v = v.double().abs().amax(dim=(1, 3))
    ds = (2 * head_dim + 4) * eps * e_s * LOG2E + exp_error
    r = u + (kv_len * 2.0**-25 if q.dtype == torch.float16 else 0.0)  # rounding, subnormals
    relative, lse_extra = u + 4 * eps, 0.0
    if gemm_sums:
        lse_extra = -math.log1p(-r)
        r = r / (1 - r)
        relative += r
    dm = merge_error(e_s, kv_len) if merge else 0.0 * e_s
    relative += 4 * eps if merge else 0.0
    per_head = m_v * (r + 2 * ds + 3 * kv_len * eps + 2 * dm)
    out_bound = _per_head(per_head) + relative * exact.abs()
    lse_bound = (2 * ds + 2 * kv_len * eps + exp_error + lse_extra + dm)[:, :, None] + 2 * eps * (
        exact_lse.abs() + (e_s * LOG2E)[:, :, None]
    )
    return out_bound, lse_bound


def merge_error(e_s, kv_len, l_max=1.0):
    """The merge of a split work tile's parts (split_merge.cuh), per batch element and head: each
    part's lse_p = m_p ln 2 + ln l_p (fp32, |m_p| <= E_s log2(e), l_p <= l_max Sk) errs by at most
    3 eps (E_s + ln(l_max Sk) + 1) absolutely, and each weight exp(lse_p - L) by that of two lse
    and exp's own: dm = 8 eps (E_s + ln(l_max Sk) + 1) relatively. The merged out moves by at most
    2 dm M_v, its lse by dm; the fp32 rows and the weighted sum add 4 eps |exact|."""
    return 8 * EPS * (e_s + math.log(l_max * max(kv_len, 1)) + 1)


def assert_within(got, exact, bound, what):
    excess = (got.double() - exact).abs() / bound
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    worst = excess.argmax()
    assert excess.max().item() <= 1.0, (
        f"{what}: error {excess.max().item():.3f}x the bound at flat index {worst.item()} "
        f"(got {got.flatten()[worst].item()!r}, exact {exact.flatten()[worst].item()!r})"
    )


def check_attention(q, k, v, key_lengths=None, scale=None, what=""):
    """ltx_kernels.attention against the exact value: out and lse, shapes, dtypes, layout."""
    out, lse = ltx_kernels.attention(q, k, v, key_lengths, scale, return_lse=True)
    exact, exact_lse = reference.attention(
        q,
        k,
        v,
        key_lengths,
        scale,
        return_lse=True,
        compute_dtype=torch.float64,
        round_output=False,
    )
    batch, q_len, heads, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous(), what
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    assert lse.shape == (batch, heads, q_len) and lse.dtype == lse_dtype, what
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    bounds = None  # (the C twin in fp32/fp16/bf16: the correctly rounded exact value)
    if q.is_cuda or q.dtype == torch.float64:
        double = (
            {"gemm_sums": q.shape[-1] == 64, "merge": True}
            if q.is_cuda
            else {
                "u": 2.0**-53,
                "eps": 2.0**-53,
                "exp_error": 2.0**-52,
            }
        )
        bounds = functools.partial(error_bounds, q, k, v, scale, exact, exact_lse, **double)
    assert_matches_exact(out, lse, exact, exact_lse, bounds, what)
    return out, lse


def assert_matches_exact(out, lse, exact, exact_lse, bounds, what) -> bool:
    """out [B, Sq, H, D] and lse [B, H, Sq] against the exact values: 0 and -inf exactly where no
    key is attended; elsewhere within bounds() = (out bound, lse bound), or (bounds None) the
    correctly rounded exact values. Whether any query attends a key."""
    no_keys = torch.isneginf(exact_lse)
    assert torch.equal(torch.isneginf(lse), no_keys), f"{what}: lse -inf where no key is attended"
    assert (out.transpose(1, 2)[no_keys] == 0).all(), f"{what}: out is 0 where no key is attended"
    finite = ~no_keys
    if not finite.any():
        return False
    if bounds is None:
        assert_rounds_exact(out, exact, f"{what} out")
        assert_rounds_exact(lse[finite], exact_lse[finite], f"{what} lse")
    else:
        out_bound, lse_bound = bounds()
        assert_within(out, exact, out_bound, f"{what} out")
        assert_within(lse[finite], exact_lse[finite], lse_bound[finite], f"{what} lse")
    return True


# ------------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len,kv_len", LENGTHS)
def test_matches_exact(device, head_dim, q_len, kv_len):
    for dtype in dtypes_for(device):
        q, k, v = make_qkv(2, q_len, kv_len, 3, head_dim, dtype, device)
        check_attention(q, k, v, what=f"{dtype} {q_len}x{kv_len} hd{head_dim}")


@pytest.mark.parametrize("sharpness", [0.0, 4.0, 16.0])
def test_flat_and_peaked_softmax(device, sharpness):
    # q = 0: every key weighs the same; large q: a few keys carry all the weight.
    for dtype in dtypes_for(device):
        q, k, v = make_qkv(2, 77, 150, 2, 64, dtype, device, sharpness)
        check_attention(q, k, v, what=f"{dtype} sharpness {sharpness}")


@pytest.mark.parametrize("scale", [1.0, 0.01, -0.2])
def test_explicit_scale(device, scale):
    # 300 keys: two whole tiles of 128 (the Hopper body's max of raw scores, or of their negations
    # for a negative scale) and a masked last one
    for head_dim in (64, 128):
        q, k, v = make_qkv(1, 70, 300, 2, head_dim, dtypes_for(device)[0], device)
        check_attention(q, k, v, scale=scale, what=f"scale {scale} hd{head_dim}")


@pytest.mark.parametrize("head_dim", [1, 8, 40, 80, 96, 200])
def test_cpu_twin_takes_any_head_dim(head_dim):
    for dtype in CPU_DTYPES:
        q, k, v = make_qkv(2, 33, 70, 2, head_dim, dtype, "cpu")
        check_attention(q, k, v, what=f"{dtype} hd{head_dim}")


@pytest.mark.parametrize("batch,heads", [(1, 1), (1, 7), (5, 1), (3, 5)])
def test_batch_and_heads(device, batch, heads):
    q, k, v = make_qkv(batch, 65, 97, heads, 64, dtypes_for(device)[0], device)
    check_attention(q, k, v, what=f"B{batch} H{heads}")


def one_key_case(batch, q_len, kv_len, heads, head_dim, dtype, device, lengths=None):
    """q, k, v where query (b, i, h) scores one key, target[b, i, h] (below its batch element's
    length), at least 200 above every other: each probability is exactly 1 or 0 (exp(-200) is 0
    in fp32)."""
    g = torch.Generator().manual_seed(q_len * 1000 + kv_len)
    k = torch.randn(batch, kv_len, heads, head_dim, generator=g, dtype=torch.float64)
    k = (k / k.norm(dim=-1, keepdim=True)).to(dtype).double()  # unit rows, exact in T
    v = torch.randn(batch, kv_len, heads, head_dim, generator=g).to(dtype)
    n = torch.full((batch,), kv_len) if lengths is None else lengths.clamp(0, kv_len)
    target = (torch.rand(batch, q_len, heads, generator=g) * n[:, None, None]).long()
    target = target.clamp(max=kv_len - 1)
    k_target = k.gather(1, target[..., None].expand(-1, -1, -1, head_dim))  # [B, Sq, H, D]
    cos = torch.einsum("bihd,bjhd->bihj", k_target, k)  # [B, Sq, H, Sk]
    cos.scatter_(-1, target[..., None], -2.0)  # the target itself does not compete
    others = cos.amax(-1).clamp(min=-1.0)  # the closest other key, by cosine
    scale = head_dim**-0.5
    # q = c k_target: score c scale (|k_t|^2 vs k_t . k_j), gap c scale (1 - cos) >= 400
    c = 400 / (scale * (1 - others))
    q = (c[..., None] * k_target).to(dtype)
    assert torch.isfinite(q).all()
    return q.to(device), k.to(dtype).to(device), v.to(device), target.to(device)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (65, 63), (127, 200), (200, 333)])
def test_each_query_attends_one_key(device, head_dim, q_len, kv_len):
    # No tolerance: out is exactly the attended key's v row.
    for dtype in dtypes_for(device):
        for lengths in (None, torch.tensor([kv_len, kv_len // 2 + 1, 1], dtype=torch.int32)):
            q, k, v, target = one_key_case(3, q_len, kv_len, 2, head_dim, dtype, device, lengths)
            key_lengths = None if lengths is None else lengths.to(device)
            out, lse = ltx_kernels.attention(q, k, v, key_lengths, return_lse=True)
            expected = v.gather(1, target[..., None].expand(-1, -1, -1, head_dim))
            wrong = (out != expected).any(-1)
            assert not wrong.any(), (
                f"{dtype} hd{head_dim} lengths {lengths}: {wrong.sum().item()} query rows are "
                f"not their key's v row, first at (b, i, h) = {wrong.nonzero()[0].tolist()}"
            )
            scores = (q.double() * k.double().gather(1, target[..., None].expand_as(q))).sum(-1)
            exact_lse = (scores * head_dim**-0.5).transpose(1, 2)
            # (lse = the target's score: its fp32 dot product, two roundings per addition)
            rtol = 2 * (2 * head_dim + 8) * EPS
            torch.testing.assert_close(lse.double(), exact_lse, rtol=rtol, atol=1e-5)


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
    for dtype in dtypes_for(device):
        for head_dim in (64, 128):
            q, k, v = make_qkv(len(lengths), 70, 130, 2, head_dim, dtype, device)
            key_lengths = torch.tensor(lengths, dtype=index_dtype, device=device)
            out, lse = check_attention(q, k, v, key_lengths, what=f"{case} {dtype} hd{head_dim}")
            # the keys past each length are not read: changing them changes nothing
            k2, v2 = k.clone(), v.clone()
            for b, n in enumerate(lengths):
                k2[b, max(n, 0) :] = float("nan")
                v2[b, max(n, 0) :] = float("nan")
            out2, lse2 = ltx_kernels.attention(q, k2, v2, key_lengths, return_lse=True)
            assert torch.equal(out2, out) and torch.equal(lse2, lse), case


def test_zero_length_gives_zeros_and_minus_inf(device):
    q, k, v = make_qkv(2, 5, 9, 3, 64, dtypes_for(device)[0], device)
    out, lse = ltx_kernels.attention(q, k, v, torch.tensor([0, 9], device=device), return_lse=True)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------
def test_slices_of_a_fused_qkv_projection(device):
    # [B, S, 3 * H * D] -> q, k, v [B, S, H, D] views (diffusers' processors), read in place.
    batch, seq, heads, head_dim = 2, 100, 3, 64
    for dtype in dtypes_for(device):
        qkv = torch.randn(batch, seq, 3 * heads * head_dim, device=device).to(dtype)
        q, k, v = qkv.unflatten(-1, (3, heads, head_dim)).unbind(2)
        assert not q.is_contiguous()
        check_attention(q, k, v, what=f"fused qkv {dtype}")
        contiguous = ltx_kernels.attention(q.contiguous(), k.contiguous(), v.contiguous())
        assert torch.equal(ltx_kernels.attention(q, k, v), contiguous)


def test_sequence_major_views(device):
    # Ulysses' receive buffer: [S, B, 3, H, D] viewed as [B, S, H, D] (batch stride < seq stride),
    # and heads-first tensors transposed ([B, H, S, D] -> [B, S, H, D]), with a longer k/v.
    for dtype in dtypes_for(device):
        buffer = torch.randn(90, 2, 3, 4, 64, device=device).to(dtype)
        q, k, v = buffer.transpose(0, 1).unbind(2)
        check_attention(q, k, v, what=f"sequence-major {dtype}")
        q = torch.randn(2, 4, 70, 128, device=device).to(dtype).transpose(1, 2)
        k = torch.randn(2, 4, 150, 128, device=device).to(dtype).transpose(1, 2)
        v = torch.randn(2, 4, 150, 128, device=device).to(dtype).transpose(1, 2)
        check_attention(q, k, v, what=f"heads-first {dtype}")


@pytest.mark.parametrize(
    "shape",
    [(0, 5, 2, 64, 7), (2, 0, 2, 64, 7), (2, 5, 0, 64, 7), (2, 5, 2, 64, 0), (0, 0, 0, 64, 0)],
    ids=["batch", "q_len", "heads", "kv_len", "all"],
)
def test_empty(device, shape):
    batch, q_len, heads, head_dim, kv_len = shape
    q, k, v = make_qkv(batch, q_len, kv_len, heads, head_dim, dtypes_for(device)[0], device)
    out, lse = check_attention(q, k, v, what=f"empty {shape}")
    if kv_len == 0 and out.numel():  # no keys: zeros, lse -inf
        assert (out == 0).all() and torch.isneginf(lse).all()
    assert ltx_kernels.attention(q, k, v).shape == q.shape


def test_lse_only_when_asked(device):
    q, k, v = make_qkv(1, 3, 4, 2, 64, dtypes_for(device)[0], device)
    out = ltx_kernels.attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = ltx_kernels.attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 3)


# ------------------------------------------------------------------------------------------------
# torch integration
# ------------------------------------------------------------------------------------------------
def test_opcheck(device):
    dtype = dtypes_for(device)[0]
    q, k, v = make_qkv(2, 9, 13, 2, 64, dtype, device)
    lengths = torch.tensor([13, 5], dtype=torch.int32, device=device)
    op = torch.ops.ltx_kernels.attention.default
    torch.library.opcheck(op, (q, k, v), {"return_lse": True})
    torch.library.opcheck(op, (q, k, v, lengths, 0.3))


def test_torch_compile_fullgraph_dynamic(device):
    dtype = dtypes_for(device)[0]
    lengths = torch.tensor([3, 40], device=device)

    def fn(q, k, v):
        out, lse = ltx_kernels.attention(q, k, v, lengths, return_lse=True)
        return out * 2, lse

    assert_compiles_once(
        fn, lambda seq: make_qkv(2, seq, seq + 5, 2, 64, dtype, device), lengths=(37, 91, 130)
    )


def test_no_backward_yet(device):
    q, k, v = make_qkv(1, 4, 6, 2, 64, dtypes_for(device)[0], device)
    q.requires_grad_(True)
    out = ltx_kernels.attention(q, k, v)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match=r"ltx_kernels\.attention has no backward yet"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not ltx_kernels.attention(q, k, v).requires_grad


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def _bad_inputs(device):
    """(name, call, message) of calls that must raise."""
    dtype = dtypes_for(device)[0]
    q, k, v = make_qkv(2, 5, 7, 3, 64, dtype, device)
    other = torch.float16 if dtype == torch.bfloat16 else torch.float64
    n = torch.tensor([7, 3], device=device)
    a = ltx_kernels.attention
    return [
        ("int q", lambda: a(q.long(), k, v), "q must be"),
        ("k dtype", lambda: a(q, k.to(other), v), "k must have q's dtype"),
        ("v dtype", lambda: a(q, k, v.to(other)), "v must have q's dtype"),
        ("3-D q", lambda: a(q[0], k, v), r"q must be 4-D \[batch, seq_len, heads, head_dim\]"),
        ("batch", lambda: a(q, k[:1], v[:1]), "k must have q's batch, heads and head_dim"),
        ("heads", lambda: a(q, k[:, :, :2], v[:, :, :2]), "k must have q's batch, heads"),
        ("head_dim", lambda: a(q, k[..., :32], v[..., :32]), "k must have q's batch, heads"),
        ("v shape", lambda: a(q, k, v[:, :6]), "v must have k's shape"),
        ("last dim", lambda: a(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "q must"),
        ("lengths dtype", lambda: a(q, k, v, n.float()), "key_lengths must be int32 or int64"),
        ("lengths shape", lambda: a(q, k, v, n[:1]), r"key_lengths must have shape \[batch\]"),
        ("lengths 2-D", lambda: a(q, k, v, n[None]), r"key_lengths must have shape \[batch\]"),
        ("inf scale", lambda: a(q, k, v, None, math.inf), "scale must be finite"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_bad_inputs_raise_naming_the_argument(device, case):
    name, call, message = _bad_inputs(device)[case]
    with pytest.raises(RuntimeError, match=rf"ltx_kernels\.attention: {message}"):
        call()


def test_the_fake_checks_shapes():
    q, k, v = (torch.empty(2, 5, 3, 64, device="meta") for _ in range(3))
    out, lse = torch.ops.ltx_kernels.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 3, 5) and lse.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"ltx_kernels\.attention: v must have k's shape"):
        torch.ops.ltx_kernels.attention(q, k, v[:, :4])
    with pytest.raises(RuntimeError, match="all tensors must be on the same device"):
        ltx_kernels.attention(torch.empty(2, 5, 3, 64), k, v)
    # the real op's dtype rules too (under torch.compile a wrong dtype fails at trace time)
    a = torch.ops.ltx_kernels.attention
    with pytest.raises(RuntimeError, match=r"attention: q must be one of .*, got torch\.int8"):
        a(q.to(torch.int8), k, v)
    with pytest.raises(RuntimeError, match=r"attention: k must be one of \(torch\.float32,\)"):
        a(q, k.bfloat16(), v)
    lengths = torch.empty(2, device="meta")
    with pytest.raises(RuntimeError, match="key_lengths must be one of"):
        a(q, k, v, lengths)
    a(q, k, v, lengths.int())


@pytest.mark.gpu
def test_cuda_limits_raise():
    q, k, v = make_qkv(2, 5, 7, 3, 64, torch.bfloat16, "cuda")
    a = ltx_kernels.attention
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(RuntimeError, match="q must be float16 or bfloat16 on CUDA"):
            a(q.to(dtype), k.to(dtype), v.to(dtype))
    for head_dim in (32, 80, 96, 256):
        q2, k2, v2 = make_qkv(2, 5, 7, 3, head_dim, torch.bfloat16, "cuda")
        with pytest.raises(RuntimeError, match=r"head_dim \(q.shape\[-1\]\) must be 64 or 128"):
            a(q2, k2, v2)
    shifted = torch.randn(2, 5, 3, 64 + 1, device="cuda").to(torch.bfloat16)[..., 1:]
    with pytest.raises(RuntimeError, match="k's rows must start at 16-byte boundaries"):
        a(q, shifted, shifted)
    with pytest.raises(RuntimeError, match="all tensors must be on the same device"):
        a(q, k.cpu(), v)
    with pytest.raises(RuntimeError, match="key_lengths is on cpu"):
        a(q, k, v, torch.tensor([7, 3]))


# ------------------------------------------------------------------------------------------------
# CUDA only: graphs, streams, the lead's larger cases
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [150, 700])  # (700: work tiles split, merged by a second kernel)
def test_cuda_graph_capture(kv_len):
    q, k, v = make_qkv(2, 100, kv_len, 2, 128, torch.bfloat16, "cuda")
    lengths = torch.tensor([kv_len, 70], device="cuda")
    graph, (out, lse) = capture_graph(
        lambda: ltx_kernels.attention(q, k, v, lengths, return_lse=True)
    )
    q.copy_(torch.randn_like(q))
    lengths.copy_(torch.tensor([20, kv_len - 1]))
    graph.replay()
    expected, expected_lse = ltx_kernels.attention(q, k, v, lengths, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    q, k, v = make_qkv(1, 200, 300, 4, 64, torch.float16, "cuda")
    expected = ltx_kernels.attention(q, k, v)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = ltx_kernels.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


@pytest.mark.gpu
def test_writes_every_output_element():
    # outputs come from a NaN-filled block of the caching allocator: a row left unwritten shows
    from helpers import poison_allocator

    q, k, v = make_qkv(3, 130, 70, 5, 128, torch.bfloat16, "cuda")
    poison_allocator("cuda", q.numel() * 2)
    out, lse = ltx_kernels.attention(q, k, v, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# Key lengths of a batch whose work tiles outnumber the SMs several times over: each persistent
# CTA runs work tiles of several lengths in a row (none, one key, partial tiles with a zeroed V
# tail, whole ones), its K/V ring, Q tiles and turns going on across them.
PERSISTENT_LENGTHS = [0, 1, 64, 65, 129, 130, 0, 200, 77, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_work_tiles_of_several_lengths_per_cta(head_dim, dtype):
    batch, q_len, heads = len(PERSISTENT_LENGTHS), 600, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert math.ceil(q_len / 192) * heads * batch > 4 * sms
    q, k, v = make_qkv(batch, q_len, 256, heads, head_dim, dtype, "cuda")
    key_lengths = torch.tensor(PERSISTENT_LENGTHS, device="cuda")
    check_attention(q, k, v, key_lengths, what=f"{dtype} hd{head_dim}")


# Work tiles split along their keys (hopper_common.cuh: split_parts): where the persistent grid's
# last round would leave most SMs idle, its tiles run in 2-4 parts on as many CTAs, merged after
# (split_merge.cuh). 36 work tiles of 9 K/V tiles split in three on any H100/H200 (tiles <= SMs /
# 2); the short key lengths leave parts without keys (merged as empty), 1100 splits unevenly.
# LTX_KERNELS_ATTENTION_SPLIT=off runs the same unsplit: both within the bounds, deterministic,
# and not bit-identical (the split ran).
SPLIT_LENGTHS = [0, 1, 129, 300, 700, 1100]


def check_split_and_unsplit(q, k, v, lengths, monkeypatch, what):
    """check_attention with work tiles split (LTX_KERNELS_ATTENTION_SPLIT "auto") and not ("off"):
    both within the bounds, the keys past the lengths never read (NaN there changes no bit, which
    also shows each deterministic), and the two not bit-identical (the split ran)."""
    key_lengths = torch.tensor(lengths, device=q.device)
    k_nan, v_nan = k.clone(), v.clone()
    for b, n in enumerate(lengths):
        k_nan[b, n:] = float("nan")
        v_nan[b, n:] = float("nan")
    outs = {}
    for split in ("auto", "off"):
        monkeypatch.setenv("LTX_KERNELS_ATTENTION_SPLIT", split)
        out, lse = check_attention(q, k, v, key_lengths, what=f"{what} split {split}")
        again = ltx_kernels.attention(q, k_nan, v_nan, key_lengths, return_lse=True)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse), f"{what} split {split}"
        outs[split] = out
    assert not torch.equal(outs["auto"], outs["off"]), f"{what}: no split"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_work_tiles(head_dim, monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper body (compute capability 9.0) splits work tiles")
    for dtype in CUDA_DTYPES:
        q, k, v = make_qkv(len(SPLIT_LENGTHS), 333, 1100, 3, head_dim, dtype, "cuda")
        what = f"{dtype} hd{head_dim}"
        check_split_and_unsplit(q, k, v, SPLIT_LENGTHS, monkeypatch, what)
        check_split_and_unsplit(q, k, v, [1100] * len(SPLIT_LENGTHS), monkeypatch, f"{what} all")


def split_after_whole_q_len(sms, batch):
    """A query length whose 192-query work tiles over `batch` elements of one head fill every SM
    once and leave a last round of at most half of them (FLUX.1's case: whole work tiles first,
    then one part of a split tile a CTA); its last query tile partial."""
    q_tiles = -(-(sms + sms // 4) // batch)
    assert sms < q_tiles * batch <= sms + sms // 2
    return 192 * q_tiles - 50


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_split_after_whole_tiles(head_dim, monkeypatch):
    # test_split_work_tiles' checks where the CTAs run whole work tiles before a split tile's part
    # (their K/V ring, Q tiles and turns going on into it; the merge's tiles offset by the whole)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper body (compute capability 9.0) splits work tiles")
    lengths = [0, 1, 300, 700, 1100]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q_len = split_after_whole_q_len(sms, len(lengths))
    q, k, v = make_qkv(len(lengths), q_len, 1100, 1, head_dim, torch.bfloat16, "cuda")
    check_split_and_unsplit(q, k, v, lengths, monkeypatch, f"hd{head_dim}")


LARGE = {
    # (batch, seq, heads, head_dim, key lengths): LTX-Video's and FLUX's shapes, fewer heads
    "ltx_hd64": (2, 2688, 4, 64, None),
    "flux_hd128_mixed": (2, 4608, 2, 128, [4608, 4096 + 77]),
    "long_odd": (1, 9999, 1, 128, [9000]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
@pytest.mark.parametrize("case", LARGE)
def test_large(case, dtype):
    batch, seq, heads, head_dim, lengths = LARGE[case]
    q, k, v = make_qkv(batch, seq, seq, heads, head_dim, dtype, "cuda")
    key_lengths = None if lengths is None else torch.tensor(lengths, device="cuda")
    check_attention(q, k, v, key_lengths, what=case)


@pytest.mark.gpu
@pytest.mark.parametrize("body", ["mma", "wgmma"])
def test_kernel_bodies(body, monkeypatch):
    # Each body pinned (a call the pinned body does not take fails): values, one-key exactness,
    # key lengths with NaN past them, and a fused-qkv slice; the bodies agree within the bounds.
    if body == "wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma body runs on compute capability 9.0 (H100/H200) only")
    monkeypatch.setenv("LTX_KERNELS_ATTENTION_KERNEL", body)
    for dtype in CUDA_DTYPES:
        for head_dim in (64, 128):
            for q_len, kv_len in [(1, 1), (65, 63), (127, 200), (200, 127), (333, 600)]:
                q, k, v = make_qkv(2, q_len, kv_len, 3, head_dim, dtype, "cuda")
                check_attention(q, k, v, what=f"{body} {dtype} {q_len}x{kv_len} hd{head_dim}")
            lengths = [0, 1, 127, 128, 129, 255, 300]
            q, k, v = make_qkv(len(lengths), 150, 300, 2, head_dim, dtype, "cuda")
            key_lengths = torch.tensor(lengths, device="cuda")
            out, lse = check_attention(q, k, v, key_lengths, what=f"{body} lengths hd{head_dim}")
            for b, n in enumerate(lengths):
                k[b, n:] = float("nan")
                v[b, n:] = float("nan")
            out2, lse2 = ltx_kernels.attention(q, k, v, key_lengths, return_lse=True)
            assert torch.equal(out2, out) and torch.equal(lse2, lse), f"{body} NaN past lengths"
            q, k, v, target = one_key_case(2, 200, 333, 2, head_dim, dtype, "cuda")
            expected = v.gather(1, target[..., None].expand(-1, -1, -1, head_dim))
            assert torch.equal(ltx_kernels.attention(q, k, v), expected), f"{body} one key"
        qkv = torch.randn(2, 100, 3 * 2 * 64, device="cuda").to(dtype)
        q, k, v = qkv.unflatten(-1, (3, 2, 64)).unbind(2)
        check_attention(q, k, v, what=f"{body} fused qkv {dtype}")
