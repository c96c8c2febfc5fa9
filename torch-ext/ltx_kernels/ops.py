"""The op wrappers: `ltx_kernels.<op>` for every op of `_op_names.OPS`, `QUANT_OPS` and
`ATTENTION_OPS`, each calling
`torch.ops.ltx_kernels.<op>` (the compiled library, loaded here with its fakes and autograd) with
its documented defaults. The package's `__init__` re-exports them."""

import torch

from . import reference
from ._op_names import ATTENTION_OPS, BACKWARD_OPS, OPS, QUANT_OPS

# the wrapper of op <op> is the function <op> of this module
__all__ = [*OPS, *QUANT_OPS, *ATTENTION_OPS]

#: Why the compiled extension failed to load, or None. When set, calling an op raises.
load_error: Exception | None = None

try:
    from ._op_namespace import ops as _ops
    from . import _autograd, _fake

    _fake.register(OPS + QUANT_OPS + ATTENTION_OPS + BACKWARD_OPS)
    _autograd.register()
except (
    ImportError,
    RuntimeError,
) as error:  # missing or stale build: stay importable for the report
    load_error = error
    _ops = None


def _library():
    if _ops is None:
        raise RuntimeError(
            "ltx_kernels: the compiled extension failed to load "
            f"({type(load_error).__name__}: {load_error}). Build it with "
            "`pip install -e . --no-build-isolation` against the torch you run with, and run "
            "`python -m ltx_kernels` for an environment report."
        ) from load_error
    return _ops


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, matching diffusers' `RMSNorm` (rounding and output dtype).

    x: [..., hidden] float32/float16/bfloat16 with a contiguous last dim (rows may be strided);
    on the CPU also float64, computed in double (for gradcheck), with a float64 weight.
    weight: None (no scale, nothing allocated) or [hidden] in any of those dtypes, on x's device.
    Returns a new contiguous tensor of x's shape, of weight's dtype (x's dtype without weight);
    see `ltx_kernels.reference.rmsnorm` for the exact rounding rule.
    """
    return _library().rmsnorm(x, weight, eps)


# ------------------------------------------------------------------------------------------------
# Fused ops for diffusion transformer blocks. Common rules:
# - x (and y) are float32/float16/bfloat16 [..., D] with a contiguous last dim; rows may be strided
#   (chunks of a fused projection, [B, S, D] slices) and are never copied. On the CPU also float64,
#   computed in double (for gradcheck; the other tensors float64, or fp32 where the op takes fp32).
# - scale, shift and gate broadcast to x: [D], [B, 1, D], [B, T, D] (per token), strided chunk or
#   unbind views of a [B, 1, 6, D] modulation tensor, [B, F, 1, D] against x viewed as
#   [B, F, S/F, D]. None skips that step.
# - upcast=False rounds every step to x.dtype as PyTorch does in the model dtype (LTX-Video, FLUX,
#   SD3); every tensor must then have x's dtype. upcast=True computes in fp32 and rounds once, as
#   Wan's `(... x.float() ...).type_as(x)`; modulation tensors (one dtype), weight and bias may
#   then be fp32. Outputs have x's dtype. `ltx_kernels.reference` holds the exact formulas.
# ------------------------------------------------------------------------------------------------
def rmsnorm_modulate(x, scale, shift, weight=None, eps: float = 1e-6, *, upcast: bool = False):
    """`RMSNorm(x) * (1 + scale) + shift` in one pass (diffusers RMSNorm, weight optional)."""
    return _library().rmsnorm_modulate(x, scale, shift, weight, eps, upcast=upcast)


def layernorm_modulate(
    x, scale, shift, weight=None, bias=None, eps: float = 1e-6, *, upcast: bool = False
):
    """`LayerNorm(x) * (1 + scale) + shift` in one pass (AdaLayerNorm; weight/bias optional)."""
    return _library().layernorm_modulate(x, scale, shift, weight, bias, eps, upcast=upcast)


def add_rmsnorm_modulate(
    x, y, scale, shift, gate=None, weight=None, eps: float = 1e-6, *, upcast: bool = False
):
    """`h = x + y * gate` (gate optional), `n = RMSNorm(h) * (1 + scale) + shift`, one pass.
    Returns (h, n)."""
    return _library().add_rmsnorm_modulate(x, y, scale, shift, gate, weight, eps, upcast=upcast)


def add_layernorm_modulate(
    x,
    y,
    scale,
    shift,
    gate=None,
    weight=None,
    bias=None,
    eps: float = 1e-6,
    *,
    upcast: bool = False,
):
    """`h = x + y * gate` (gate optional), `n = LayerNorm(h) * (1 + scale) + shift`, one pass.
    Returns (h, n)."""
    return _library().add_layernorm_modulate(
        x, y, scale, shift, gate, weight, bias, eps, upcast=upcast
    )


def gated_residual(x, y, gate=None, *, upcast: bool = False):
    """`x + y * gate` (`x + y` without gate) in one pass."""
    return _library().gated_residual(x, y, gate, upcast=upcast)


def rope(x, cos, sin, interleaved: bool = True):
    """Rotary embedding (diffusers `apply_rotary_emb`, fp32 math, one rounding).
    x: [B, S, D] (LTX: over the full hidden dim) or [B, S, H, Dh] (per head). cos/sin broadcast
    to x ([S, D], [B, S, D], [1, S, 1, Dh]; [S, Dh] with a 4-D x is shared by the heads), fp32 or
    x's dtype, width D, or D/2 with interleaved=False (LTX-2 split RoPE). interleaved: pairs
    (2i, 2i+1) as FLUX/HunyuanVideo/Wan/LTX; False: halves (i, i + D/2)."""
    return _library().rope(x, cos, sin, interleaved)


def qk_rmsnorm_rope(
    q,
    k,
    q_weight,
    k_weight,
    cos,
    sin,
    eps: float = 1e-6,
    across_heads: bool = True,
    interleaved: bool = True,
):
    """torch.nn.RMSNorm of q and k, then RoPE (cos=None: norm only), both in one launch.
    across_heads=True: norm over the token ([B, S, D], or [B, S, H, Dh] with heads contiguous),
    weight [D]; False: per head ([..., Dh]), weight [Dh]. q/k may be row-strided views of a fused
    QKV projection. Returns new (q, k)."""
    return _library().qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved
    )


def gelu(x, approximate: str = "none"):
    """`F.gelu(x, approximate=approximate)` ("none": erf form, torch's default, or "tanh"), fp32
    math, one rounding."""
    return _library().gelu(x, approximate)


def geglu(x, approximate: str = "none"):
    """diffusers GEGLU after its projection: `h, g = x.chunk(2, -1); h * gelu(g, approximate)`,
    [..., 2H] -> [..., H]."""
    return _library().geglu(x, approximate)


def linear_gelu(x, weight, bias=None):
    """`F.gelu(F.linear(x, weight, bias), approximate="tanh")` as one cuBLASLt GEMM with a GELU
    epilogue (through `torch._addmm_activation`) on CUDA. x [..., K], weight [N, K], bias [N]."""
    return _library().linear_gelu(x, weight, bias)


def lora_linear(x, weight, bias=None, lora_a=(), lora_b=(), scaling=(), offsets=None):
    """peft's LoRA Linear, `F.linear(x, weight, bias) + lora_b(lora_a(x)) * scaling`, for any
    number of adapters, each adding to its own output columns: adapter j (lora_a[j] [r_j, K],
    lora_b[j] [N_j, r_j], scaling[j]) adds scaling[j] * (x @ lora_a[j].T) @ lora_b[j].T to columns
    offsets[j] : offsets[j] + N_j of the [..., N] output (default: the adapters' columns one after
    another from 0, as for q, k and v projections fused in one weight [N, K]). The base GEMM, one
    GEMM for all down-projections, and one GEMM per adapter that adds its update in place
    (alpha = scaling); under autograd one node whose backward is GEMMs, from x and the saved
    x @ lora_a[j].T. Every tensor has x's dtype; roundings as reference.lora_linear."""
    offsets = reference._consecutive_offsets(lora_b) if offsets is None else offsets
    return _library().lora_linear(
        x, weight, bias, list(lora_a), list(lora_b), [float(s) for s in scaling], list(offsets)
    )


# ------------------------------------------------------------------------------------------------
# Quantized-output ops (inference only, `inject_optimized_kernels(..., fp8=True)`): the producer's
# value, rounded to x.dtype as its model-dtype op rounds it, quantized in the same pass to
# `format` (QUANT_FORMATS; `ltx_kernels.reference.quantize_rows` gives each format's rule).
# "e4m3_row": float8_e4m3fn with one fp32 scale per row, a = max(amax(|row|), 1e-12),
# q = e4m3(row * (448 / a)) rounded to nearest even and saturating at +-448, scale = a / 448. Each
# returns (q, q_scale), q of x's shape and q_scale [...] (one per row), after h for the add_ ops:
# the operands of a rowwise-scaled `torch._scaled_mm`. No backward: differentiating them raises.
# ------------------------------------------------------------------------------------------------
def rmsnorm_modulate_quant(
    x, scale, shift, weight=None, eps: float = 1e-6, *, upcast: bool = False, format="e4m3_row"
):
    """rmsnorm_modulate, its output quantized: (q, q_scale)."""
    return _library().rmsnorm_modulate_quant(
        x, scale, shift, weight, eps, upcast=upcast, format=format
    )


def layernorm_modulate_quant(
    x,
    scale,
    shift,
    weight=None,
    bias=None,
    eps: float = 1e-6,
    *,
    upcast: bool = False,
    format="e4m3_row",
):
    """layernorm_modulate, its output quantized: (q, q_scale)."""
    return _library().layernorm_modulate_quant(
        x, scale, shift, weight, bias, eps, upcast=upcast, format=format
    )


def add_rmsnorm_modulate_quant(
    x,
    y,
    scale,
    shift,
    gate=None,
    weight=None,
    eps: float = 1e-6,
    *,
    upcast: bool = False,
    format="e4m3_row",
):
    """add_rmsnorm_modulate with n quantized: (h, q, q_scale)."""
    return _library().add_rmsnorm_modulate_quant(
        x, y, scale, shift, gate, weight, eps, upcast=upcast, format=format
    )


def add_layernorm_modulate_quant(
    x,
    y,
    scale,
    shift,
    gate=None,
    weight=None,
    bias=None,
    eps: float = 1e-6,
    *,
    upcast: bool = False,
    format="e4m3_row",
):
    """add_layernorm_modulate with n quantized: (h, q, q_scale)."""
    return _library().add_layernorm_modulate_quant(
        x, y, scale, shift, gate, weight, bias, eps, upcast=upcast, format=format
    )


def qk_rmsnorm_rope_quant(
    q,
    k,
    q_weight,
    k_weight,
    cos,
    sin,
    eps: float = 1e-6,
    across_heads: bool = True,
    interleaved: bool = True,
    *,
    format="i8_row",
):
    """qk_rmsnorm_rope with q's output quantized per head in the same pass: (q8, q_scale, k).
    q [B, S, H, Dh] gives q8 [B, S, H, Dh] and q_scale [B, S, H] (one scale per token and head:
    the 8-bit attention's q operand with "i8_row"); k is qk_rmsnorm_rope's (for
    quantize_attention_k, whose mean needs the whole sequence). Each head's values are exactly
    qk_rmsnorm_rope's q, quantized with reference.quantize_rows's rule."""
    return _library().qk_rmsnorm_rope_quant(
        q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved, format=format
    )


def quantize(x, activation: str = "none", approximate: str = "none", *, format="e4m3_row"):
    """x, or gelu(x, approximate) rounded to x.dtype (activation "gelu"), quantized: (q, q_scale).
    x [..., K] float32/float16/bfloat16, contiguous last dim, rows may be strided. Also quantizes
    Linear weights [N, K] (one scale per output channel)."""
    return _library().quantize(x, activation, approximate, format=format)


def attention(q, k, v, key_lengths=None, scale=None, *, return_lse: bool = False):
    """Softmax attention, non-causal: `softmax(q @ k^T * scale) @ v` per batch element and head, in
    diffusers' layout. q [B, Sq, H, D], k and v [B, Sk, H, D] (the same H), any strides with a
    contiguous last dim (slices of a fused qkv projection are read where they are). Returns out
    [B, Sq, H, D] (contiguous, q's dtype), or with return_lse=True (out, lse): lse [B, H, Sq] the
    natural-log log-sum-exp of each query's scaled scores (float32; float64 for float64 inputs),
    what ring attention merges partial outputs with.
    key_lengths: None (every key), or an int32/int64 [B] tensor on q's device: batch element b
    attends keys [0, key_lengths[b]) only (values clamped to [0, Sk]). A length of 0 gives out = 0
    and lse = -inf (no key to attend: not the NaN of a softmax over nothing).
    scale: default D**-0.5.
    CUDA: float16/bfloat16, head_dim 64 or 128 (other head dims raise; attend with
    F.scaled_dot_product_attention there), rows 16-byte aligned; tensor cores with fp32
    accumulation, the probabilities rounded to q's dtype before `p @ v`. CPU: also float32 and
    float64, any head_dim, computed in double and rounded once (reference.attention is the exact
    formula). No backward yet: differentiating it raises."""
    out, lse = _library().attention(q, k, v, key_lengths, scale, return_lse=return_lse)
    return (out, lse) if return_lse else out


def attention_int8(
    q8,
    q_scale,
    k8,
    k_scale,
    v8,
    v_scale,
    key_lengths=None,
    scale=None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    return_lse: bool = False,
):
    """`attention` over 8-bit operands: exactly `attention(q, k, v, key_lengths, scale)` of the
    dequantized tensors (reference.attention_int8), computed on Hopper with INT8 q.k and FP8 p.v.
    - q8: int8 [B, Sq, H, D] (rows of D contiguous, any other strides), q_scale: float32 [B, Sq, H]
      (q = q8 * q_scale, one scale per token and head).
    - k8: int8 [B, Sk, H, D], k_scale: float32 [B, H, ceil(Sk / 128)] (k = k8 * k_scale, one scale
      per head and block of 128 keys). k may be smoothed (a per-(batch, head) mean subtracted from
      every key: softmax-invariant).
    - v8: float8_e4m3fn [B, H, D, Sk_pad], V transposed (keys contiguous), Sk_pad >= Sk rounded up
      to 16, key j at column c(j) = reference.v8_columns(Sk)[j]: each group of 16 keys permuted
      into the order the Hopper kernel's scores leave its accumulators (quantize_attention_v
      writes it; codes in the columns holding no key leave the result unchanged), v_scale:
      float32 [B, H, D] (v[b, j, h, d] = v8[b, h, d, c(j)] * v_scale[b, h, d], one per channel).
    - key_lengths, scale, return_lse: as `attention` (lse: float32, float64 for float64 out).
    Returns out [B, Sq, H, D] in out_dtype (bfloat16 or float16; the CPU backend also float32 and
    float64). CUDA: compute capability 9.0 only, D 64 or 128, 16-byte aligned rows; the scores are
    exact integer dot products scaled in fp32, the probabilities (times 448) rounded to e4m3 before
    p.v (fp32 accumulation, promoted every 128 keys), the row sums (out's divisor and lse's) of the
    same rounded probabilities. CPU: any D, computed in double and rounded
    once. No backward: differentiating it raises."""
    out, lse = _library().attention_int8(
        q8,
        q_scale,
        k8,
        k_scale,
        v8,
        v_scale,
        key_lengths,
        scale,
        out_dtype=out_dtype,
        return_lse=return_lse,
    )
    return (out, lse) if return_lse else out


def quantize_attention_k(k):
    """The INT8 k operand of 8-bit attention: (k8, k_scale). k [B, S, H, D] float32/float16/
    bfloat16, any strides with a contiguous last dim. k is smoothed by its per-(batch, head) mean
    over the sequence (fp32; subtracting a vector common to all keys leaves the softmax unchanged),
    then quantized per head and block of 128 keys with the "i8_row" rule: k8 int8 [B, S, H, D]
    contiguous, k_scale float32 [B, H, ceil(S / 128)], k - mean ~ k8 * k_scale (reference
    .quantize_attention_k is the exact rule; CUDA sums the mean in fp32, the CPU in double). Two
    passes over k (the mean, then the codes). CUDA: head_dim <= 256."""
    return _library().quantize_attention_k(k)


def quantize_attention_v(v):
    """The FP8 v operand of 8-bit attention: (v8, v_scale). v [B, S, H, D] float32/float16/
    bfloat16, any strides with a contiguous last dim. Each channel (b, h, d) is scaled by its amax
    over the sequence ("e4m3_row" rule): v8 float8_e4m3fn [B, H, D, S_pad] transposed (keys
    contiguous, in attention_int8's column order reference.v8_columns; S_pad = S rounded up to 16,
    pad columns 0), v_scale float32 [B, H, D], v ~ v8 * v_scale (reference.quantize_attention_v is
    the exact rule, bit for bit on CPU and CUDA). Two
    passes over v (the maxima, then the transposed codes). CUDA: head_dim <= 256."""
    return _library().quantize_attention_v(v)
