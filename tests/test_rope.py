"""rope and qk_rmsnorm_rope against float64 evaluations of the references with the same rounding
points, on CPU and CUDA: every dtype, hidden sizes with odd pair counts, 1/7/4096 rows, pairs /
halves / split (half-width) tables, cos/sin in fp32 and in x's dtype, every table broadcast form
([S, D], [B, S, D], [S, Dh] shared by heads, [1, S, 1, Dh], per head, strided), 3-D and 4-D
(head-split and transposed) q/k, views of a fused QKV projection, cross-attention (q and k of
different lengths), empty tensors, opcheck, torch.compile, CUDA graphs, bad inputs, and parity with
diffusers' apply_rotary_emb (LTX-Video, LTX-2 split, FLUX pairs and halves) and torch.nn.RMSNorm."""

import math

import pytest
import torch

import ltx_kernels
from ltx_kernels import reference

from helpers import (
    DTYPES,
    LAYOUTS,
    assert_compiles_once,
    assert_new_contiguous,
    assert_rounds_within,
    capture_graph,
    make_activation,
    poison_allocator,
    rows_hidden_cases,
    skip_big_on_cpu,
    varied_rows,
)

# Even widths; 110, 770 and 5126 have an odd number of pairs (55, 385, 2563): scalar tails.
ROPE_HIDDEN = [110, 770, 1536, 2048, 3072, 5120, 5126]
# (interleaved, table width as a fraction of the head dim): pairs (2i, 2i+1) as FLUX / Wan /
# LTX-Video, halves (i, i + D/2) as CogView4 / Cosmos, and halves sharing a half-width table as
# LTX-2's split RoPE.
MODES = {"pairs": (True, 1), "halves": (False, 1), "split": (False, 2)}
TABLE_DTYPES = ["fp32", "same"]


def make_tables(shape, dtype, device, width):
    """cos, sin of random angles, of `shape` with last dimension `width`."""
    theta = torch.rand(*shape[:-1], width, device=device) * (8 * math.pi)
    return theta.cos().to(dtype), theta.sin().to(dtype)


def tables_for(kind, x_shape, mode, table_dtype, x_dtype, device):
    """cos, sin in the broadcast form `kind` for x of x_shape ([B, S, D] or [B, S, H, Dh]):
    SD [S, D]; BSD [B, S, D]; 1SD [1, S, D]; chunked: row-strided halves of one [S, 2D] table;
    S_Dh [S, Dh] shared by the heads of a 4-D x; 1S1Dh [1, S, 1, Dh] (Wan); BS1Dh [B, S, 1, Dh];
    BSHDh per head; BHSDh_T [B, H, S, Dh].transpose(1, 2) (LTX-2's per-head tables, heads
    strided); 11SDh [1, 1, S, Dh] for a [B, H, S, Dh] x."""
    dtype = torch.float32 if table_dtype == "fp32" else x_dtype
    width = x_shape[-1] // MODES[mode][1]
    batch, seq = x_shape[0], x_shape[1]
    if kind == "chunked":
        cos, sin = make_tables((seq, width), dtype, device, width)
        return torch.cat([cos, sin], dim=-1).chunk(2, dim=-1)
    if kind == "BHSDh_T":
        heads = x_shape[2]
        cos, sin = make_tables((batch, heads, seq, width), dtype, device, width)
        return cos.transpose(1, 2), sin.transpose(1, 2)
    shape = {
        "SD": (seq, width),
        "BSD": (batch, seq, width),
        "1SD": (1, seq, width),
        "S_Dh": (seq, width),
        "1S1Dh": (1, seq, 1, width),
        "BS1Dh": (batch, seq, 1, width),
        "BSHDh": (*x_shape[:3], width),
        "11SDh": (1, 1, x_shape[2], width),
    }[kind]
    return make_tables(shape, dtype, device, width)


def exact_rope(v, cos, sin, interleaved):
    return reference.rope(v, cos, sin, interleaved, compute_dtype=torch.float64, round_output=False)


def rope_magnitude(v, cos, sin, interleaved):
    """|v| * |cos| + |rotate(v)| * |sin| per element (float64): what the fp32 products sum."""
    v = v.double().abs()
    cos, sin = cos.double().abs(), sin.double().abs()
    return (
        exact_rope(v, cos, torch.zeros_like(sin), interleaved)
        + exact_rope(v, torch.zeros_like(cos), sin, interleaved).abs()
    )


def check_rope(x, cos, sin, interleaved, what=""):
    what = (
        f"{what} rope x {tuple(x.shape)}/{x.dtype} cos {tuple(cos.shape)}/{cos.dtype} "
        f"interleaved={interleaved}"
    )
    poison_allocator(x.device.type, x.numel() * x.element_size())
    out = ltx_kernels.rope(x, cos, sin, interleaved)
    assert_new_contiguous([out], [x, cos, sin], x.dtype, x.shape, what)
    assert_rounds_within(
        out,
        exact_rope(x, cos, sin, interleaved),
        what,
        slop_magnitude=rope_magnitude(x, cos, sin, interleaved),
    )
    return out


def check_qk(
    q, k, q_weight, k_weight, cos, sin, eps=1e-6, across_heads=True, interleaved=True, what=""
):
    """Both outputs against the float64 reference. With a rotation the normalized v is rounded
    to T first (one intermediate rounding, carried by |cos| + |sin|)."""
    what = (
        f"{what} qk_rmsnorm_rope q {tuple(q.shape)} k {tuple(k.shape)} {q.dtype} weights "
        f"{None if q_weight is None else q_weight.dtype}/"
        f"{None if k_weight is None else k_weight.dtype} cos "
        f"{None if cos is None else (tuple(cos.shape), cos.dtype)} across_heads="
        f"{across_heads} interleaved={interleaved}"
    )
    for t in (q, k):
        poison_allocator(q.device.type, t.numel() * t.element_size())
    outs = ltx_kernels.qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved
    )
    args = (q, k, q_weight, k_weight)
    exact = reference.qk_rmsnorm_rope(
        *args,
        cos,
        sin,
        eps,
        across_heads,
        interleaved,
        compute_dtype=torch.float64,
        round_output=False,
    )
    normalized = reference.qk_rmsnorm_rope(
        *args, None, None, eps, across_heads, compute_dtype=torch.float64, round_output=False
    )
    for name, x, out, ex, v in zip("qk", (q, k), outs, exact, normalized):
        assert_new_contiguous(
            [out], [q, k, q_weight, k_weight, cos, sin], q.dtype, x.shape, f"{what}: {name}"
        )
        if cos is None:
            assert_rounds_within(out, ex, f"{what}: {name}")
        else:
            magnitude = rope_magnitude(v, cos, sin, interleaved)
            assert_rounds_within(
                out, ex, f"{what}: {name}", roundings=1, magnitude=magnitude, intermediate_scale=2.0
            )
    return outs


def norm_weight(kind, size, dtype, device):
    if kind == "none":
        return None
    return (1 + 0.5 * torch.randn(size, device=device)).to(
        torch.float32 if kind == "fp32" else dtype
    )


# ------------------------------------------------------------------------------------------------
# rope
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,hidden", rows_hidden_cases(ROPE_HIDDEN))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_matches_reference(device, dtype, rows, hidden, mode, table_dtype):
    # LTX-Video: rotation over the whole hidden dim of [B, S, D], tables [S, D].
    skip_big_on_cpu(
        device,
        rows,
        hidden,
        keep=(mode, table_dtype) in {("pairs", "fp32"), ("split", "same")},
        cpu_hidden=(770, 1536),
    )
    x = varied_rows((1, rows, hidden), dtype, device)
    cos, sin = tables_for("SD", x.shape, mode, table_dtype, dtype, device)
    check_rope(x, cos, sin, MODES[mode][0])


@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["SD", "BSD", "1SD", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_tables_3d(device, dtype, kind, mode, table_dtype):
    x = varied_rows((2, 12, 264), dtype, device)
    check_rope(x, *tables_for(kind, x.shape, mode, table_dtype, dtype, device), MODES[mode][0])


@pytest.mark.parametrize("head_dim", [64, 128, 72])
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["S_Dh", "1S1Dh", "BS1Dh", "BSHDh", "BHSDh_T"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_tables_per_head(device, dtype, kind, mode, table_dtype, head_dim):
    # [B, S, H, Dh] (FLUX / Wan with sequence_dim=1): one table row per token shared by the heads,
    # or one per head.
    x = varied_rows((2, 12, 3 * head_dim), dtype, device).unflatten(-1, (3, head_dim))
    check_rope(x, *tables_for(kind, x.shape, mode, table_dtype, dtype, device), MODES[mode][0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_heads_first(device, dtype, mode):
    # [B, H, S, Dh] as a transposed view of [B, S, H, Dh] (rows on three levels), tables
    # [1, 1, S, Dh] (diffusers' sequence_dim=2).
    x = varied_rows((2, 12, 4 * 64), dtype, device).unflatten(-1, (4, 64)).transpose(1, 2)
    check_rope(x, *tables_for("11SDh", x.shape, mode, "fp32", dtype, device), MODES[mode][0])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_strided_rows(device, dtype, layout):
    for mode, (interleaved, _) in MODES.items():
        x = make_activation((2, 9, 640), dtype, device, layout)
        check_rope(x, *tables_for("SD", x.shape, mode, "fp32", dtype, device), interleaved)
        x4 = make_activation((2, 9, 5 * 128), dtype, device, layout).unflatten(-1, (5, 128))
        check_rope(x4, *tables_for("S_Dh", x4.shape, mode, "same", dtype, device), interleaved)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64), (2, 0, 4, 32), (3, 0)])
def test_rope_empty(device, shape):
    x = torch.randn(shape, device=device).to(torch.bfloat16)
    cos, sin = make_tables((*shape[:-1], shape[-1]), torch.float32, device, shape[-1])
    out = ltx_kernels.rope(x, cos, sin)
    assert_new_contiguous([out], [], x.dtype, shape, "empty")


def test_rope_errors(device):
    bf16 = torch.bfloat16
    x = torch.randn(2, 12, 64, device=device).to(bf16)
    cos, sin = make_tables((12, 64), torch.float32, device, 64)

    def raises(pattern, *args):
        with pytest.raises(RuntimeError, match=f"ltx_kernels.rope: {pattern}"):
            ltx_kernels.rope(*args)

    if device == "cpu":  # float64 runs the C twin in double (fp32 tables too; test_gradcheck.py)
        assert ltx_kernels.rope(x.double(), cos, sin).dtype == torch.float64
        raises(
            "cos must be float64 or float32, got bfloat16", x.double(), cos.to(bf16), sin.to(bf16)
        )
    else:
        raises("x is float64, which only the CPU backend takes", x.double(), cos, sin)
    raises(r"x must be float32, float16, bfloat16 or \(CPU\) float64, got int32", x.int(), cos, sin)
    raises("x must have a contiguous last dimension", x.transpose(1, 2), cos[:, :12], sin[:, :12])
    raises("x must have at least 1 dimension", x[0, 0, 0], cos, sin)
    raises("cos and sin must have the same shape", x, cos, sin[:1])
    raises("cos must have last dimension 64", x, cos[:, :32], sin[:, :32])
    raises("cos must have last dimension 64 or 32", x, cos[:, :48], sin[:, :48], False)
    raises("rotation needs an even last dimension, got 63", x[..., :63], cos[:, :63], sin[:, :63])
    raises("cos must be bfloat16 or float32", x, cos.half(), sin.half())
    raises("cos must be float32, float16 or bfloat16, got float64", x, cos.double(), sin.double())
    raises("sin must have the dtype of cos", x, cos, sin.to(bf16))
    raises(
        r"cos with shape \[3, 12, 64\] does not broadcast to x's shape",
        x,
        cos.expand(3, 12, 64),
        sin.expand(3, 12, 64),
    )
    raises(
        r"cos with shape \[13, 64\] does not broadcast to x's shape",
        x,
        torch.ones(13, 64, device=device),
        torch.ones(13, 64, device=device),
    )
    raises(
        "cos must have a contiguous last dimension",
        x,
        cos.t().contiguous().t(),
        sin.t().contiguous().t(),
    )


@pytest.mark.gpu
def test_rope_device_mismatch():
    x = torch.randn(2, 12, 64, device="cuda").to(torch.bfloat16)
    cos, sin = make_tables((12, 64), torch.float32, "cuda", 64)
    with pytest.raises(RuntimeError, match="cos is on cpu but x is on cuda:0"):
        ltx_kernels.rope(x, cos.cpu(), sin)
    with pytest.raises(RuntimeError, match="sin is on cpu but x is on cuda:0"):
        ltx_kernels.rope(x, cos, sin.cpu())


def _assert_matches_model(out, expected, what):
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    match = (out == expected).float().mean().item()
    assert match > 0.99, f"{what}: only {match:.4f} of the elements equal diffusers' output"


def test_rope_matches_diffusers_ltx(device):
    # LTX-Video: rotation over the full hidden dim, fp32 cos/sin [B, S, D] repeated per pair.
    ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")
    x = torch.randn(2, 96, 2048, device=device).to(torch.bfloat16)
    theta = torch.rand(2, 96, 1024, device=device) * 50
    cos, sin = (t.repeat_interleave(2, dim=-1) for t in (theta.cos(), theta.sin()))
    expected = ltx.apply_rotary_emb(x, (cos, sin))
    _assert_matches_model(ltx_kernels.rope(x, cos, sin), expected, "LTX-Video apply_rotary_emb")


def test_rope_matches_diffusers_ltx2(device):
    # LTX-2: split RoPE, half-width per-head tables [B, H, T, Dh/2] against x [B, T, H*Dh]; and
    # its interleaved variant.
    ltx2 = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
    batch, seq, heads, head_dim = 2, 40, 8, 128
    x = torch.randn(batch, seq, heads * head_dim, device=device).to(torch.bfloat16)
    cos, sin = make_tables((batch, heads, seq, head_dim // 2), torch.float32, device, head_dim // 2)
    expected = ltx2.apply_split_rotary_emb(x, (cos, sin))
    out = ltx_kernels.rope(
        x.unflatten(-1, (heads, head_dim)),
        cos.transpose(1, 2),
        sin.transpose(1, 2),
        interleaved=False,
    )
    _assert_matches_model(out.flatten(-2), expected, "LTX-2 apply_split_rotary_emb")
    cos, sin = make_tables((batch, seq, heads * head_dim), torch.float32, device, heads * head_dim)
    expected = ltx2.apply_interleaved_rotary_emb(x, (cos, sin))
    _assert_matches_model(
        ltx_kernels.rope(x, cos, sin), expected, "LTX-2 apply_interleaved_rotary_emb"
    )


@pytest.mark.parametrize("unbind_dim", [-1, -2])
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_rope_matches_diffusers_apply_rotary_emb(device, unbind_dim, sequence_dim):
    # diffusers.models.embeddings.apply_rotary_emb(use_real=True): pairs (unbind_dim=-1, FLUX,
    # CogVideoX, HunyuanDiT) or halves (-2: Stable Audio, CogView4, Cosmos); fp32 [S, Dh] tables;
    # x [B, S, H, Dh] (sequence_dim=1) or [B, H, S, Dh] (sequence_dim=2, a transposed view).
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    x = torch.randn(2, 77, 6, 128, device=device).to(torch.bfloat16)
    if sequence_dim == 2:
        x = x.transpose(1, 2)
    cos, sin = make_tables((77, 128), torch.float32, device, 128)
    expected = embeddings.apply_rotary_emb(
        x, (cos, sin), use_real=True, use_real_unbind_dim=unbind_dim, sequence_dim=sequence_dim
    )
    tables = (cos, sin) if sequence_dim == 1 else (cos[None, None], sin[None, None])
    out = ltx_kernels.rope(x, *tables, interleaved=unbind_dim == -1)
    _assert_matches_model(out, expected, f"apply_rotary_emb(unbind_dim={unbind_dim})")


# ------------------------------------------------------------------------------------------------
# qk_rmsnorm_rope
# ------------------------------------------------------------------------------------------------
def make_qk(kind, dtype, device, batch=2, seq=12, heads=3, head_dim=64, layout="contiguous"):
    """q, k and across_heads for the attention layouts:
    ltx:  [B, S, D], norm and rotation over D (LTX-Video);
    wan:  [B, S, H, Dh], norm over the token (H*Dh), rotation per head;
    flux: [B, S, H, Dh], norm and rotation per head;
    flux_bhsd: [B, H, S, Dh] (transposed view), norm and rotation per head."""
    hidden = heads * head_dim
    q, k = (varied_rows((batch, seq, hidden), dtype, device, layout) for _ in range(2))
    if kind == "ltx":
        return q, k, True
    q, k = (t.unflatten(-1, (heads, head_dim)) for t in (q, k))
    if kind == "flux_bhsd":
        return q.transpose(1, 2), k.transpose(1, 2), False
    return q, k, kind == "wan"


QK_TABLES = {"ltx": "BSD", "wan": "1S1Dh", "flux": "S_Dh", "flux_bhsd": "11SDh"}


@pytest.mark.parametrize("weight_kind", ["none", "same", "fp32"])
@pytest.mark.parametrize("table_dtype", TABLE_DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["ltx", "wan", "flux", "flux_bhsd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_matches_reference(device, dtype, kind, mode, table_dtype, weight_kind):
    q, k, across_heads = make_qk(kind, dtype, device)
    cos, sin = tables_for(QK_TABLES[kind], q.shape, mode, table_dtype, dtype, device)
    size = q.shape[-1] * (q.shape[-2] if across_heads and q.dim() == 4 else 1)
    check_qk(
        q,
        k,
        norm_weight(weight_kind, size, dtype, device),
        norm_weight(weight_kind, size, dtype, device),
        cos,
        sin,
        across_heads=across_heads,
        interleaved=MODES[mode][0],
    )


@pytest.mark.parametrize("rows,hidden", rows_hidden_cases(ROPE_HIDDEN))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_hidden_sizes(device, dtype, rows, hidden):
    skip_big_on_cpu(device, rows, hidden, cpu_hidden=(770, 1536))
    q, k = (varied_rows((1, rows, hidden), dtype, device) for _ in range(2))
    cos, sin = tables_for("SD", q.shape, "pairs", "fp32", dtype, device)
    check_qk(
        q,
        k,
        norm_weight("same", hidden, dtype, device),
        norm_weight("same", hidden, dtype, device),
        cos,
        sin,
    )


@pytest.mark.parametrize("kind", ["ltx", "wan", "flux"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_norm_only_and_cross_attention(device, dtype, kind):
    # cos=None: norm only. Cross-attention: k from the text tokens, another length than q.
    q, _, across_heads = make_qk(kind, dtype, device, seq=12)
    _, k, _ = make_qk(kind, dtype, device, seq=29)
    size = q.shape[-1] * (q.shape[-2] if across_heads and q.dim() == 4 else 1)
    for weights in (
        (None, None),
        (norm_weight("same", size, dtype, device), norm_weight("fp32", size, dtype, device)),
    ):
        check_qk(q, k, *weights, None, None, across_heads=across_heads)
        check_qk(q, q, *weights, None, None, across_heads=across_heads)  # same tensor twice


@pytest.mark.parametrize("kind", ["ltx", "wan", "flux"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_views_of_a_fused_qkv_projection(device, dtype, kind):
    # q, k = to_qkv(x).chunk(3, -1): rows 3D apart, heads split with unflatten.
    heads, head_dim = 4, 64
    qkv = varied_rows((2, 10, 3 * heads * head_dim), dtype, device)
    q, k, _ = qkv.chunk(3, dim=-1)
    across_heads = kind != "flux"
    if kind != "ltx":
        q, k = (t.unflatten(-1, (heads, head_dim)) for t in (q, k))
    table_kind = {"ltx": "BSD", "wan": "1S1Dh", "flux": "S_Dh"}[kind]
    for mode, (interleaved, _) in MODES.items():
        cos, sin = tables_for(table_kind, q.shape, mode, "fp32", dtype, device)
        size = q.shape[-1] * (heads if across_heads and q.dim() == 4 else 1)
        check_qk(
            q,
            k,
            norm_weight("same", size, dtype, device),
            None,
            cos,
            sin,
            across_heads=across_heads,
            interleaved=interleaved,
        )


@pytest.mark.parametrize("layout", ["row_strided", "misaligned"])
@pytest.mark.parametrize("kind", ["ltx", "wan", "flux"])
def test_qk_strided_rows(device, kind, layout):
    q, k, across_heads = make_qk(kind, torch.bfloat16, device, layout=layout)
    cos, sin = tables_for(QK_TABLES[kind], q.shape, "pairs", "fp32", torch.bfloat16, device)
    check_qk(q, k, None, None, cos, sin, across_heads=across_heads)


def test_qk_eps_is_used(device):
    q, k, _ = make_qk("ltx", torch.float32, device)
    cos, sin = tables_for("BSD", q.shape, "pairs", "fp32", torch.float32, device)
    for eps in (0.0, 1e-5, 0.1):
        check_qk(q * 1e-2, k * 1e-2, None, None, cos, sin, eps)


@pytest.mark.parametrize("kind", ["ltx", "wan", "flux"])
def test_qk_empty(device, kind):
    q, k, across_heads = make_qk(kind, torch.bfloat16, device, seq=0)
    cos, sin = tables_for(QK_TABLES[kind], q.shape, "pairs", "fp32", torch.bfloat16, device)
    outs = ltx_kernels.qk_rmsnorm_rope(q, k, None, None, cos, sin, 1e-6, across_heads)
    for out, x in zip(outs, (q, k)):
        assert_new_contiguous([out], [], x.dtype, x.shape, "empty")
    _, k2, _ = make_qk(kind, torch.bfloat16, device, seq=5)  # empty q, non-empty k
    outs = ltx_kernels.qk_rmsnorm_rope(q, k2, None, None, None, None, 1e-6, across_heads)
    assert_new_contiguous([outs[0]], [], q.dtype, q.shape, "empty q")
    check_qk(q, k2, None, None, None, None, across_heads=across_heads)


def test_qk_errors(device):
    bf16 = torch.bfloat16
    q, k, _ = make_qk("wan", bf16, device, heads=3, head_dim=64)
    cos, sin = tables_for("1S1Dh", q.shape, "pairs", "fp32", bf16, device)
    w = norm_weight("same", 192, bf16, device)

    def raises(pattern, *args):
        with pytest.raises(RuntimeError, match=f"ltx_kernels.qk_rmsnorm_rope: {pattern}"):
            ltx_kernels.qk_rmsnorm_rope(*args)

    if device == "cpu":  # float64 runs the C twin in double (gradcheck: test_gradcheck.py)
        out = ltx_kernels.qk_rmsnorm_rope(q.double(), k.double(), w.double(), None, cos, sin)
        assert out[0].dtype == out[1].dtype == torch.float64
        raises(
            "q_weight must be float64 or float32, got bfloat16",
            q.double(),
            k.double(),
            w,
            None,
            cos,
            sin,
        )
    else:
        raises(
            "q is float64, which only the CPU backend takes",
            q.double(),
            k.double(),
            None,
            None,
            None,
            None,
        )
    raises(
        r"q must be float32, float16, bfloat16 or \(CPU\) float64, got int32",
        q.int(),
        k.int(),
        None,
        None,
        None,
        None,
    )
    raises(
        "k must be float32, float16 or bfloat16, got float64", q, k.double(), None, None, None, None
    )
    raises("k must have q's dtype", q, k.half(), None, None, None, None)
    raises(
        "q must have a contiguous last dimension",
        q.transpose(-1, -2),
        k.transpose(-1, -2),
        None,
        None,
        None,
        None,
        1e-6,
        False,
    )
    # across_heads=True with a 4-D q whose heads are strided ([B, H, S, Dh] transposed).
    raises(
        "with across_heads=True the q heads must be contiguous",
        q.transpose(1, 2),
        k.transpose(1, 2),
        None,
        None,
        None,
        None,
        1e-6,
        True,
    )
    raises(r"q_weight must have shape \[hidden\] = \[192\]", q, k, w[:64], None, cos, sin)
    raises(r"k_weight must have shape \[hidden\] = \[64\]", q, k, None, w, cos, sin, 1e-6, False)
    raises("q_weight must be bfloat16 or float32", q, k, w.half(), None, cos, sin)
    raises("eps must be finite and >= 0", q, k, None, None, cos, sin, -1.0)
    raises("cos and sin must have the same shape", q, k, None, None, cos, sin[:, :5])
    raises("cos must have last dimension 64", q, k, None, None, cos[..., :32], sin[..., :32])
    raises("cos must be bfloat16 or float32", q, k, None, None, cos.half(), sin.half())
    raises(
        "rotation needs an even last dimension, got 63",
        q[..., :63],
        k[..., :63],
        None,
        None,
        cos[..., :63],
        sin[..., :63],
        1e-6,
        False,
    )
    # Cross-attention lengths with one table: the table does not fit k.
    _, k_text, _ = make_qk("wan", bf16, device, seq=29)
    raises(r"cos with shape \[1, 12, 1, 64\] does not broadcast", q, k_text, None, None, cos, sin)


@pytest.mark.gpu
def test_qk_device_mismatch():
    q, k, _ = make_qk("ltx", torch.bfloat16, "cuda")
    cos, sin = tables_for("BSD", q.shape, "pairs", "fp32", torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="k is on cpu but q is on cuda:0"):
        ltx_kernels.qk_rmsnorm_rope(q, k.cpu(), None, None, None, None)
    with pytest.raises(RuntimeError, match="q_weight is on cpu but x is on cuda:0"):
        ltx_kernels.qk_rmsnorm_rope(q, k, torch.ones(192), None, cos, sin)
    with pytest.raises(RuntimeError, match="cos is on cpu but x is on cuda:0"):
        ltx_kernels.qk_rmsnorm_rope(q, k, None, None, cos.cpu(), sin)


def test_qk_matches_ltx_attention(device):
    # LTXAttention: torch.nn.RMSNorm(heads * dim_head, eps=1e-5) on q and k (bf16 weights), then
    # transformer_ltx.apply_rotary_emb over the full dim with fp32 [B, S, D] tables.
    ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")
    dim, bf16 = 2048, torch.bfloat16
    norm_q = torch.nn.RMSNorm(dim, eps=1e-5).to(device, bf16)
    norm_k = torch.nn.RMSNorm(dim, eps=1e-5).to(device, bf16)
    with torch.no_grad():
        for norm in (norm_q, norm_k):
            norm.weight.copy_(1 + 0.3 * torch.randn(dim))
    q = torch.randn(2, 96, dim, device=device).to(bf16)
    k = torch.randn(2, 96, dim, device=device).to(bf16)
    theta = torch.rand(2, 96, dim // 2, device=device) * 50
    cos, sin = (t.repeat_interleave(2, dim=-1) for t in (theta.cos(), theta.sin()))
    expected_q = ltx.apply_rotary_emb(norm_q(q), (cos, sin))
    expected_k = ltx.apply_rotary_emb(norm_k(k), (cos, sin))
    out_q, out_k = ltx_kernels.qk_rmsnorm_rope(
        q, k, norm_q.weight, norm_k.weight, cos, sin, 1e-5, True, True
    )
    _assert_matches_model(out_q, expected_q, "LTX q")
    _assert_matches_model(out_k, expected_k, "LTX k")


def test_qk_matches_flux_attention(device):
    # FluxAttention: per-head torch.nn.RMSNorm(dim_head) on [B, S, H, Dh], then
    # embeddings.apply_rotary_emb(sequence_dim=1) with fp32 [S, Dh] tables.
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    heads, head_dim, bf16 = 6, 128, torch.bfloat16
    norm = torch.nn.RMSNorm(head_dim, eps=1e-6).to(device, bf16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(head_dim))
    q, k = (
        torch.randn(2, 77, heads * head_dim, device=device).to(bf16).unflatten(-1, (heads, -1))
        for _ in range(2)
    )
    cos, sin = make_tables((77, head_dim), torch.float32, device, head_dim)
    expected = [embeddings.apply_rotary_emb(norm(t), (cos, sin), sequence_dim=1) for t in (q, k)]
    outs = ltx_kernels.qk_rmsnorm_rope(q, k, norm.weight, norm.weight, cos, sin, 1e-6, False)
    for out, exp, name in zip(outs, expected, "qk"):
        _assert_matches_model(out, exp, f"FLUX {name}")


def test_qk_matches_wan_attention(device):
    # WanAttention: torch.nn.RMSNorm(heads * dim_head) over the token, unflatten to heads, then
    # the processor's own rotary (copied from diffusers 0.42.1 WanAttnProcessor, a closure there)
    # with fp32 [1, S, 1, Dh] tables repeated per pair.
    heads, head_dim, bf16 = 12, 128, torch.bfloat16
    dim = heads * head_dim
    norm = torch.nn.RMSNorm(dim, eps=1e-6).to(device, bf16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim))

    from ltx_kernels.integration.wan import wan_rope  # WanAttnProcessor's closure, verbatim

    def wan_rotary(hidden_states, freqs_cos, freqs_sin):
        return wan_rope(hidden_states, (freqs_cos, freqs_sin))

    theta = torch.rand(1, 50, 1, head_dim // 2, device=device) * 50
    cos, sin = (t.repeat_interleave(2, dim=-1) for t in (theta.cos(), theta.sin()))
    q, k = (torch.randn(2, 50, dim, device=device).to(bf16) for _ in range(2))
    expected = [wan_rotary(norm(t).unflatten(2, (heads, -1)), cos, sin) for t in (q, k)]
    outs = ltx_kernels.qk_rmsnorm_rope(
        q.unflatten(2, (heads, -1)),
        k.unflatten(2, (heads, -1)),
        norm.weight,
        norm.weight,
        cos,
        sin,
        1e-6,
        True,
    )
    for out, exp, name in zip(outs, expected, "qk"):
        _assert_matches_model(out, exp, f"Wan {name}")


# ------------------------------------------------------------------------------------------------
# torch.library, torch.compile, CUDA graphs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(device, dtype):
    ops = torch.ops.ltx_kernels
    x = make_activation((2, 6, 96), dtype, device, "row_strided")
    for mode, (interleaved, _) in MODES.items():
        cos, sin = tables_for("SD", x.shape, mode, "fp32", dtype, device)
        torch.library.opcheck(ops.rope.default, (x, cos, sin, interleaved))
    q, k, _ = make_qk("wan", dtype, device, layout="row_strided")
    cos, sin = tables_for("1S1Dh", q.shape, "pairs", "same", dtype, device)
    w = norm_weight("fp32", 192, dtype, device)
    torch.library.opcheck(ops.qk_rmsnorm_rope.default, (q, k, w, w, cos, sin, 1e-6, True, True))
    torch.library.opcheck(
        ops.qk_rmsnorm_rope.default, (q, k[:, :5], None, None, None, None, 1e-6, False, True)
    )


def _attention_inputs(x, qk_weight, table):
    """LTX-style: q, k chunks of a fused projection, cos/sin halves of one table, both fused ops."""
    q, k, _ = x.chunk(3, dim=-1)
    cos, sin = table.chunk(2, dim=-1)
    q, k = ltx_kernels.qk_rmsnorm_rope(q, k, qk_weight, qk_weight, cos, sin)
    return q * 2 + 1, k, ltx_kernels.rope(q, cos, sin)


def test_compile_fullgraph_no_recompile(device):
    bf16 = torch.bfloat16
    weight = (1 + 0.3 * torch.randn(128, device=device)).to(bf16)
    assert_compiles_once(
        _attention_inputs,
        lambda seq: (
            torch.randn(2, seq, 3 * 128, device=device).to(bf16),
            weight,
            torch.rand(seq, 2 * 128, device=device) * 6 - 3,
        ),
    )


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    bf16 = torch.bfloat16
    q, k, _ = make_qk("wan", bf16, "cuda", seq=256, heads=16, head_dim=128)
    cos, sin = tables_for("1S1Dh", q.shape, "pairs", "fp32", bf16, "cuda")
    w = norm_weight("same", 2048, bf16, "cuda")
    x = varied_rows((2, 256, 2048), bf16, "cuda")
    cos3, sin3 = tables_for("SD", x.shape, "split", "fp32", bf16, "cuda")

    def step():
        return (
            *ltx_kernels.qk_rmsnorm_rope(q, k, w, w, cos, sin),
            ltx_kernels.rope(x, cos3, sin3, False),
        )

    graph, outs = capture_graph(step)
    for _ in range(2):  # new data in the captured inputs, then replay
        for t in (q, k, x):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        torch.cuda.synchronize()
        for out, expected in zip(outs, step()):
            assert torch.equal(out, expected), "graph replay differs from an eager call"
        check_rope(x, cos3, sin3, False, "graph replay")
        check_qk(q, k, w, w, cos, sin, what="graph replay")
