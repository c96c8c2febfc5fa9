"""Pure-PyTorch references of every ltx_kernels op, with the same signatures and the same rounding
points as the kernels.

Uses:
- Debugging (the seed's one-op-at-a-time method): swap `ltx_kernels.<op>` for
  `ltx_kernels.reference.<op>` to take a kernel out of the picture.
- Tests: `compute_dtype=torch.float64` evaluates the same math exactly, rounding only where the
  kernel (and the diffusers code it replaces) rounds; `round_output=False` also skips the final
  rounding, giving the exact value the kernel's output is a rounding of.
"""

import torch

from ._op_names import ATTENTION_OPS, OPS, QUANT_FORMATS, QUANT_OPS

# the reference of op <op> is the function <op> of this module
__all__ = [*OPS, *QUANT_OPS, *ATTENTION_OPS]

_HALF_TYPES = (torch.float16, torch.bfloat16)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    compute_dtype: torch.dtype = torch.float32,
    round_output: bool = True,
) -> torch.Tensor:
    """diffusers' RMSNorm (`models/normalization.py`) over the last dim.

    y = x * rsqrt(mean(x^2) + eps) in compute_dtype; without weight the result is rounded to
    x.dtype; with an fp16/bf16 weight y is rounded to weight.dtype, multiplied by the weight and
    rounded again; with an fp32 weight the product is returned in fp32. So the output dtype is
    weight.dtype with a weight and x.dtype without.
    """
    y = x.to(compute_dtype)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if weight.dtype in _HALF_TYPES:
            y = y.to(weight.dtype).to(compute_dtype)
        y = y * weight.to(compute_dtype)
    return y.to(weight.dtype if weight is not None else x.dtype) if round_output else y


# ------------------------------------------------------------------------------------------------
# Fused ops. T is x.dtype. With upcast=False every elementwise step is rounded to T, as PyTorch
# does when all operands have dtype T (LTX-Video, FLUX, SD3); with upcast=True everything is
# computed in compute_dtype and rounded once (Wan's `x.float() ... .type_as(x)`). See ltx_kernels.h.
# ------------------------------------------------------------------------------------------------


def _rounder(dtype: torch.dtype, upcast: bool):
    """R(v): v rounded to `dtype` and widened back, or v itself when upcast."""
    if upcast:
        return lambda v: v
    return lambda v: v.to(dtype).to(v.dtype)


def _residual(x, y, gate, upcast, c):
    """round_T(x + R(y * gate)) (or x + y), returned unrounded in compute dtype c."""
    R = _rounder(x.dtype, upcast)
    t = y.to(c) if gate is None else R(y.to(c) * gate.to(c))
    return x.to(c) + t


def _norm_modulate(h, scale, shift, weight, bias, eps, kind, upcast, c, out_dtype):
    """Norm + modulation of h (already rounded to out_dtype), unrounded result in c."""
    R = _rounder(out_dtype, upcast)
    hc = h.to(c)
    if kind == "rms":
        y = hc * torch.rsqrt(hc.pow(2).mean(-1, keepdim=True) + eps)
        n = R(R(y) * weight.to(c)) if weight is not None else R(y)
    else:
        mean = hc.mean(-1, keepdim=True)
        y = (hc - mean) * torch.rsqrt((hc - mean).pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.to(c)
        if bias is not None:
            y = y + bias.to(c)
        n = R(y)
    if scale is not None:
        n = R(n * R(1 + scale.to(c)))
    if shift is not None:
        n = n + shift.to(c)
    return n


def _finish(v, dtype, round_output):
    return v.to(dtype) if round_output else v


def rmsnorm_modulate(
    x,
    scale,
    shift,
    weight=None,
    eps=1e-6,
    *,
    upcast=False,
    compute_dtype=torch.float32,
    round_output=True,
):
    """`RMSNorm(x) * (1 + scale) + shift` with diffusers' RMSNorm (weight optional); with
    upcast=True `(RMSNorm(x.float()) * (1 + scale) + shift).type_as(x)` computed in fp32.
    scale/shift broadcast to x (None skips that step). Output dtype x.dtype."""
    n = _norm_modulate(x, scale, shift, weight, None, eps, "rms", upcast, compute_dtype, x.dtype)
    return _finish(n, x.dtype, round_output)


def layernorm_modulate(
    x,
    scale,
    shift,
    weight=None,
    bias=None,
    eps=1e-6,
    *,
    upcast=False,
    compute_dtype=torch.float32,
    round_output=True,
):
    """`F.layer_norm(x, weight, bias, eps) * (1 + scale) + shift` (AdaLayerNorm); with upcast=True
    `(FP32LayerNorm(x.float()) * (1 + scale) + shift).type_as(x)` (Wan)."""
    n = _norm_modulate(x, scale, shift, weight, bias, eps, "layer", upcast, compute_dtype, x.dtype)
    return _finish(n, x.dtype, round_output)


def add_rmsnorm_modulate(
    x,
    y,
    scale,
    shift,
    gate=None,
    weight=None,
    eps=1e-6,
    *,
    upcast=False,
    compute_dtype=torch.float32,
    round_output=True,
):
    """h = x + y * gate (x + y without gate); n = rmsnorm_modulate(h, ...). Returns (h, n)."""
    h = _residual(x, y, gate, upcast, compute_dtype)
    n = _norm_modulate(
        h.to(x.dtype), scale, shift, weight, None, eps, "rms", upcast, compute_dtype, x.dtype
    )
    return _finish(h, x.dtype, round_output), _finish(n, x.dtype, round_output)


def add_layernorm_modulate(
    x,
    y,
    scale,
    shift,
    gate=None,
    weight=None,
    bias=None,
    eps=1e-6,
    *,
    upcast=False,
    compute_dtype=torch.float32,
    round_output=True,
):
    """h = x + y * gate (x + y without gate); n = layernorm_modulate(h, ...). Returns (h, n)."""
    h = _residual(x, y, gate, upcast, compute_dtype)
    n = _norm_modulate(
        h.to(x.dtype), scale, shift, weight, bias, eps, "layer", upcast, compute_dtype, x.dtype
    )
    return _finish(h, x.dtype, round_output), _finish(n, x.dtype, round_output)


def gated_residual(
    x, y, gate=None, *, upcast=False, compute_dtype=torch.float32, round_output=True
):
    """`x + y * gate` (`x + y` without gate) as PyTorch rounds it in x.dtype; with upcast=True
    `(x.float() + y * gate.float()).type_as(x)`."""
    return _finish(_residual(x, y, gate, upcast, compute_dtype), x.dtype, round_output)


def _rope_tables(x, table, head_dim, interleaved):
    """cos/sin as a tensor broadcastable to x: a 2-D [S, r] table with a 4-D [B, S, H, Dh] x is
    shared by all heads; a half-width table (rotate-halves only) covers both halves."""
    if x.dim() == 4 and table.dim() == 2:
        table = table[:, None, :]
    if table.shape[-1] * 2 == head_dim and not interleaved:
        table = torch.cat([table, table], dim=-1)
    return table


def _rotate(v, cos, sin, interleaved, c):
    """v * cos + rotate(v) * sin over the last dim, in compute dtype c."""
    v = v.to(c)
    if interleaved:
        rotated = torch.stack([-v[..., 1::2], v[..., 0::2]], dim=-1).flatten(-2)
    else:
        half = v.shape[-1] // 2
        rotated = torch.cat([-v[..., half:], v[..., :half]], dim=-1)
    return v * cos.to(c) + rotated * sin.to(c)


def rope(x, cos, sin, interleaved=True, *, compute_dtype=torch.float32, round_output=True):
    """Rotary embedding over the last dim of x, as diffusers' `apply_rotary_emb`
    (`(x.float() * cos + x_rotated.float() * sin).to(x.dtype)`).

    x: [B, S, D] (LTX: rotation over the full hidden dim) or [B, S, H, Dh] (per head).
    cos, sin: broadcastable to x ([S, D], [B, S, D], [1, S, 1, Dh], ...), or [S, Dh] with a 4-D x;
    width x.shape[-1], or x.shape[-1] / 2 with interleaved=False (both halves share it, as
    LTX-2's split RoPE). interleaved=True rotates pairs (2i, 2i+1), False halves (i, i + D/2).
    """
    d = x.shape[-1]
    cos, sin = (_rope_tables(x, t, d, interleaved) for t in (cos, sin))
    return _finish(_rotate(x, cos, sin, interleaved, compute_dtype), x.dtype, round_output)


def qk_rmsnorm_rope(
    q,
    k,
    q_weight,
    k_weight,
    cos,
    sin,
    eps=1e-6,
    across_heads=True,
    interleaved=True,
    *,
    compute_dtype=torch.float32,
    round_output=True,
):
    """torch.nn.RMSNorm of q and k (weight optional, one rounding to the input dtype), then RoPE
    (skipped when cos is None), as attention processors do:
    - across_heads=True: the norm spans the whole token: the last dim of a [B, S, D] tensor (LTX,
      whose RoPE also spans D) or the last two dims of [B, S, H, Dh] (Wan: norm over D, RoPE per
      head); weight [D].
    - across_heads=False: the norm spans one head, the last dim of [..., Dh] (FLUX); weight [Dh].
    Returns (q_out, k_out) of q's and k's shapes and dtype."""

    def one(x, weight):
        c = compute_dtype
        dims = (-2, -1) if across_heads and x.dim() == 4 else (-1,)
        xc = x.to(c)
        v = xc * torch.rsqrt(xc.pow(2).mean(dims, keepdim=True) + eps)
        if weight is not None:
            v = v * weight.to(c).reshape(x.shape[dims[0] :])
        if cos is None:
            return _finish(v, x.dtype, round_output)
        v = v.to(x.dtype)
        d = x.shape[-1]
        tables = [_rope_tables(x, t, d, interleaved) for t in (cos, sin)]
        return _finish(_rotate(v, *tables, interleaved, c), x.dtype, round_output)

    return one(q, q_weight), one(k, k_weight)


def gelu(x, approximate="none", *, compute_dtype=torch.float32, round_output=True):
    """`F.gelu(x, approximate=approximate)`: computed in compute_dtype, rounded once."""
    return _finish(
        torch.nn.functional.gelu(x.to(compute_dtype), approximate=approximate),
        x.dtype,
        round_output,
    )


def geglu(x, approximate="none", *, compute_dtype=torch.float32, round_output=True):
    """diffusers' GEGLU after its projection: `hidden, gate = x.chunk(2, -1); hidden * gelu(gate)`,
    with gelu(gate) rounded to x.dtype before the product. [..., 2H] -> [..., H]."""
    hidden, gate = x.chunk(2, dim=-1)
    g = torch.nn.functional.gelu(gate.to(compute_dtype), approximate=approximate)
    g = g.to(x.dtype).to(compute_dtype)
    return _finish(hidden.to(compute_dtype) * g, x.dtype, round_output)


def linear_gelu(x, weight, bias=None, *, compute_dtype=torch.float32, round_output=True):
    """`F.gelu(F.linear(x, weight, bias), approximate="tanh")` in compute_dtype, rounded once
    (diffusers' `GELU(dim, inner, approximate="tanh")` projection)."""
    c = compute_dtype
    y = torch.nn.functional.linear(x.to(c), weight.to(c), None if bias is None else bias.to(c))
    return _finish(torch.nn.functional.gelu(y, approximate="tanh"), x.dtype, round_output)


def _consecutive_offsets(lora_b) -> list[int]:
    """lora_linear's default offsets: the adapters' output columns one after another from 0."""
    offsets, column = [], 0
    for b in lora_b:
        offsets.append(column)
        column += b.shape[0]
    return offsets


def lora_linear(
    x,
    weight,
    bias=None,
    lora_a=(),
    lora_b=(),
    scaling=(),
    offsets=None,
    *,
    compute_dtype=torch.float32,
    round_output=True,
):
    """`F.linear(x, weight, bias)` plus, for each adapter j, scaling[j] * (x @ lora_a[j].T) @
    lora_b[j].T added to output columns offsets[j]... (peft's LoRA Linear), in compute_dtype,
    rounded to x.dtype where the op rounds: the base GEMM's output, each x @ lora_a[j].T, and
    each column block once after its update."""
    c = compute_dtype

    def rounded(v):
        return v.to(x.dtype).to(c) if round_output else v

    xc = x.to(c)
    linear = torch.nn.functional.linear
    out = rounded(linear(xc, weight.to(c), None if bias is None else bias.to(c)))
    offsets = _consecutive_offsets(lora_b) if offsets is None else offsets
    for a, b, s, o in zip(lora_a, lora_b, scaling, offsets):
        t = rounded(linear(xc, a.to(c)))
        columns = slice(o, o + b.shape[0])
        update = rounded(out[..., columns] + s * linear(t, b.to(c)))
        out = torch.cat([out[..., :o], update, out[..., o + b.shape[0] :]], dim=-1)
    return _finish(out, x.dtype, round_output)


# ------------------------------------------------------------------------------------------------
# Quantized-output ops (inference only). Each computes the value v its model-dtype op returns
# (rounded to x.dtype as that op rounds it), then quantizes the rows of v to `format` with the rule
# of quantize_rows. The GEMM that consumes them multiplies row r of q by scale[r]
# (torch._scaled_mm's rowwise scaling).
# ------------------------------------------------------------------------------------------------
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
I8_MAX = 127.0  # the largest int8 code of the symmetric INT8 rule
MIN_AMAX = 1e-12  # the amax of an all-zero row is taken as this (scale > 0)


def _codes(v: torch.Tensor, amax: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """v (fp32) quantized with the amax a broadcast to it (a clamped to >= 1e-12): the codes of
    fl32(v * fl32(code_max / a)) in `format` and the scales fl32(a / code_max)."""
    amax = torch.clamp(amax, min=MIN_AMAX)
    code_max = torch.full_like(amax, I8_MAX if format == "i8_row" else E4M3_MAX)
    scaled = v * (code_max / amax)
    if format == "i8_row":  # rint (ties to even), clamped; NaN gives 0
        q = torch.where(scaled.isnan(), 0.0, scaled.round().clamp(-I8_MAX, I8_MAX)).to(torch.int8)
    else:
        q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, amax / code_max


def quantize_rows(v: torch.Tensor, format: str = "e4m3_row") -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of v [..., K] (values exact in fp32) quantized to `format` (QUANT_FORMATS):
    "e4m3_row", torchao's rowwise rule:
    a = max(max |v| over the row, 1e-12) (NaN if the row has one);
    q = round_nearest_even_e4m3(clamp(fl32(v * fl32(448 / a)), -448, 448));
    scale = fl32(a / 448), the factor the GEMM multiplies row r of q by.
    Returns (q [..., K] float8_e4m3fn, scale [...] float32). q * scale approximates v within half
    an e4m3 step (3 mantissa bits: relative error <= 2^-4 for normal values, plus fp32's 2^-23).
    "i8_row", symmetric INT8 (attention's q with rows of head_dim): the same a,
    q = clamp(rint(fl32(v * fl32(127 / a))), -127, 127) (ties to even; NaN gives 0),
    scale = fl32(a / 127); q int8, within half a step a / 254 of v.
    (Divisions are tensor by tensor: torch's CUDA division by a Python scalar multiplies by its
    rounded reciprocal, which is not the correctly rounded quotient the kernels compute.)"""
    if format not in QUANT_FORMATS:
        raise ValueError(f"quantize_rows: format must be one of {QUANT_FORMATS}, got {format!r}")
    v = v.float()
    if v.shape[-1] == 0:
        amax = v.new_zeros(v.shape[:-1] + (1,))
    else:
        amax = v.abs().amax(-1, keepdim=True)
    q, scale = _codes(v, amax, format)
    return q, scale.squeeze(-1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32):
    """q * scale (row r of q times scale[r]) in `dtype`."""
    return (q.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


def rmsnorm_modulate_quant(
    x, scale, shift, weight=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    """rmsnorm_modulate's output quantized: returns (q, q_scale)."""
    return quantize_rows(rmsnorm_modulate(x, scale, shift, weight, eps, upcast=upcast), format)


def layernorm_modulate_quant(
    x, scale, shift, weight=None, bias=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    """layernorm_modulate's output quantized: returns (q, q_scale)."""
    n = layernorm_modulate(x, scale, shift, weight, bias, eps, upcast=upcast)
    return quantize_rows(n, format)


def add_rmsnorm_modulate_quant(
    x, y, scale, shift, gate=None, weight=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    """add_rmsnorm_modulate with n quantized: returns (h, q, q_scale)."""
    h, n = add_rmsnorm_modulate(x, y, scale, shift, gate, weight, eps, upcast=upcast)
    return (h, *quantize_rows(n, format))


def add_layernorm_modulate_quant(
    x,
    y,
    scale,
    shift,
    gate=None,
    weight=None,
    bias=None,
    eps=1e-6,
    *,
    upcast=False,
    format="e4m3_row",
):
    """add_layernorm_modulate with n quantized: returns (h, q, q_scale)."""
    h, n = add_layernorm_modulate(x, y, scale, shift, gate, weight, bias, eps, upcast=upcast)
    return (h, *quantize_rows(n, format))


def qk_rmsnorm_rope_quant(
    q,
    k,
    q_weight,
    k_weight,
    cos,
    sin,
    eps=1e-6,
    across_heads=True,
    interleaved=True,
    *,
    format="i8_row",
):
    """qk_rmsnorm_rope with q's output quantized per last-dim row (per head of a [B, S, H, Dh] q):
    returns (q8, q_scale, k)."""
    q_out, k_out = qk_rmsnorm_rope(
        q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved
    )
    return (*quantize_rows(q_out, format), k_out)


def quantize(x, activation="none", approximate="none", *, format="e4m3_row"):
    """x, or gelu(x, approximate) rounded to x.dtype first (activation "gelu": the input of an FF
    down projection), quantized: returns (q, q_scale). Used on activations that no norm op
    produces and on weights ([N, K]: one scale per output channel)."""
    if activation not in ("none", "gelu"):
        raise ValueError("quantize: activation must be 'none' or 'gelu'")
    if activation == "gelu":
        x = gelu(x, approximate)
    return quantize_rows(x, format)


def attention(
    q,
    k,
    v,
    key_lengths=None,
    scale=None,
    *,
    return_lse=False,
    compute_dtype=torch.float32,
    round_output=True,
):
    """Softmax attention (non-causal) as ltx_kernels.attention defines it, in compute_dtype:
    s = scale * q k^T per batch element and head over the keys j < key_lengths[b] (clamped to
    [0, Sk]; every key without lengths), lse = logsumexp(s) (natural log), out = exp(s - lse) v,
    rounded once to q.dtype ([B, Sq, H, D] contiguous); lse [B, H, Sq] float32 (float64 for
    float64 inputs). No keys: out 0, lse -inf. round_output=False leaves both in compute_dtype.
    compute_dtype=float64 is the exact value the op's output is a rounding of: the C twin computes
    it in double; the CUDA kernel also rounds the probabilities to q.dtype before `p @ v` (an error
    of at most one rounding of q.dtype times max |v|)."""
    c = compute_dtype
    head_dim, kv_len = q.shape[-1], k.shape[1]
    scale = (head_dim**-0.5 if head_dim > 0 else 1.0) if scale is None else scale
    qh, kh, vh = (t.to(c).transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    s = (qh @ kh.transpose(-1, -2)) * scale  # [B, H, Sq, Sk]
    if key_lengths is not None:
        n = key_lengths.to(torch.int64).clamp(0, kv_len)
        attended = torch.arange(kv_len, device=q.device) < n[:, None]  # [B, Sk]
        s = s.masked_fill(~attended[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for a query without keys
    no_keys = torch.isneginf(lse).unsqueeze(-1)
    p = torch.where(no_keys, 0.0, torch.exp(s - lse.unsqueeze(-1)))
    out = (p @ vh).transpose(1, 2)
    if round_output:
        out = out.to(q.dtype).contiguous()
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return (out, lse) if return_lse else out


def v8_columns(kv_len, device=None):
    """The columns of v8 that hold keys 0..kv_len-1 (ltx_attention_v_column in ltx_kernels.h): each
    group of 16 keys in the order the Hopper kernel's score accumulators hold them, key
    16 g + 8 h + 2 t + e at column 16 g + 4 t + 2 h + e (t < 4; h, e < 2). int64 [kv_len]."""
    key = torch.arange(kv_len, device=device)
    r = key % 16
    return key - r + (r & 6) * 2 + (r & 8) // 4 + (r & 1)


def v8_keys(v8, kv_len):
    """The codes of keys 0..kv_len-1 of v8 [B, H, D, Sk_pad] in key order (its v8_columns), the
    inverse of the layout: [B, H, D, kv_len] float8_e4m3fn."""
    return v8.view(torch.uint8)[..., v8_columns(kv_len, v8.device)].view(v8.dtype)


def _dequantize_attention_int8(q8, q_scale, k8, k_scale, v8, v_scale, dtype=torch.float64):
    """The operands attention_int8 attends, in dtype: q = q8 q_scale, k = k8 k_scale (a scale per
    block of 128 keys), v = (v8 v_scale) read back in key order (v8_columns) and transposed to
    [B, Sk, H, D] (the other columns of v8 dropped)."""
    kv_len = k8.shape[1]
    q = q8.to(dtype) * q_scale.to(dtype)[..., None]
    per_key = k_scale.to(dtype).repeat_interleave(128, dim=-1)[..., :kv_len]  # [B, H, Sk]
    k = k8.to(dtype) * per_key.transpose(1, 2)[..., None]
    v = (v8_keys(v8, kv_len).to(dtype) * v_scale.to(dtype)[..., None]).permute(0, 3, 1, 2)
    return q, k, v


def _v8_of_keys(codes, kv_len):
    """codes [B, H, D, Sk] (e4m3, keys in order) as v8: columns in v8_columns order, Sk rounded up
    to 16, the other columns 0."""
    kv_pad = -(-kv_len // 16) * 16
    v8 = torch.zeros((*codes.shape[:3], kv_pad), dtype=torch.uint8, device=codes.device)
    v8[..., v8_columns(kv_len, codes.device)] = codes.view(torch.uint8)
    return v8.view(torch.float8_e4m3fn)


def _quantize_attention_int8(q, k, v, key_lengths=None):
    """q [B, Sq, H, D], k and v [B, Sk, H, D] as attention_int8's operands, in plain PyTorch (the
    tests' and benchmarks' quantizer; the fused quantizing ops produce the same contract): q8 with
    one scale per token and head (amax / 127); k smoothed by its per-(batch, head) mean over the
    attended keys (softmax-invariant), then int8 with one scale per head and block of 128 keys;
    v8 e4m3 with one scale per channel (amax / 448), transposed to [B, H, D, Sk rounded up to 16]
    in v8_columns order with zero padding. Returns (q8, q_scale, k8, k_scale, v8, v_scale)."""
    batch, kv_len, heads, head_dim = k.shape
    blocks = -(-kv_len // 128)
    q_scale = q.float().abs().amax(-1).clamp_min(1e-20) / 127
    q8 = (q.float() / q_scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    attended = torch.ones(batch, kv_len, device=k.device)
    if key_lengths is not None:
        attended = (torch.arange(kv_len, device=k.device) < key_lengths[:, None]).float()
    count = attended.sum(1).clamp_min(1)[:, None, None]  # [B, 1, 1]
    mean = (k.float() * attended[..., None, None]).sum(1) / count  # [B, H, D]
    smoothed = k.float() - mean[:, None]
    per_block = torch.nn.functional.pad(smoothed, (0, 0, 0, 0, 0, blocks * 128 - kv_len))
    k_scale = per_block.unflatten(1, (blocks, 128)).abs().amax(dim=(2, 4)).transpose(1, 2)
    k_scale = k_scale.clamp_min(1e-20) / 127  # [B, H, blocks]
    per_key = k_scale.repeat_interleave(128, dim=-1)[..., :kv_len].transpose(1, 2)  # [B, Sk, H]
    k8 = (smoothed / per_key[..., None]).round().clamp(-127, 127).to(torch.int8)
    v_abs = v.float().abs()
    v_amax = v_abs.amax(1) if kv_len else v_abs.new_zeros(batch, heads, head_dim)
    v_scale = v_amax.clamp_min(1e-20) / 448  # [B, H, D]
    codes = (v.float().permute(0, 2, 3, 1) / v_scale[..., None]).to(torch.float8_e4m3fn)
    v8 = _v8_of_keys(codes, kv_len)
    return q8, q_scale.contiguous(), k8, k_scale.contiguous(), v8, v_scale.contiguous()


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
    out_dtype=torch.bfloat16,
    return_lse=False,
    compute_dtype=torch.float32,
    round_output=True,
):
    """ltx_kernels.attention_int8: `attention` (above, in compute_dtype) of the dequantized
    operands (_dequantize_attention_int8), out rounded once to out_dtype; compute_dtype=float64 is
    the exact value the op's output is a rounding of (the C twin computes it in double; the CUDA
    kernel also rounds the probabilities, times 448, to e4m3 before `p @ v`)."""
    q, k, v = _dequantize_attention_int8(q8, q_scale, k8, k_scale, v8, v_scale, compute_dtype)
    out, lse = attention(
        q,
        k,
        v,
        key_lengths,
        scale,
        return_lse=True,
        compute_dtype=compute_dtype,
        round_output=False,
    )
    if round_output:
        out = out.to(out_dtype).contiguous()
        lse = lse.to(torch.float64 if out_dtype == torch.float64 else torch.float32)
    return (out, lse) if return_lse else out


def quantize_attention_k(k, *, compute_dtype=torch.float64):
    """ltx_kernels.quantize_attention_k's rule: mean = fl32(sum_s k / S) per (batch, head) (summed
    in compute_dtype: float64 is the C twin's; CUDA sums in fp32), c = fl32(k - mean), and per
    (batch, head, block of 128 keys) the "i8_row" rule over the block's S_block x D values of c.
    Returns (k8 int8 [B, S, H, D], k_scale float32 [B, H, ceil(S / 128)])."""
    batch, kv_len, heads, head_dim = k.shape
    blocks = -(-kv_len // 128)
    if kv_len > 0:
        mean = (k.to(compute_dtype).sum(1) / kv_len).float()  # [B, H, D]
    else:
        mean = k.new_zeros((batch, heads, head_dim), dtype=torch.float32)
    c = k.float() - mean[:, None]
    padded = torch.nn.functional.pad(c, (0, 0, 0, 0, 0, blocks * 128 - kv_len))
    grouped = padded.view(batch, blocks, 128, heads, head_dim)
    if grouped.numel() > 0:  # (amax propagates NaN)
        amax = grouped.abs().amax(4).amax(2, keepdim=True)  # [B, blocks, 1, H]
    else:
        amax = grouped.new_zeros((batch, blocks, 1, heads))
    q, scale = _codes(grouped, amax[..., None], "i8_row")
    k8 = q.view(batch, blocks * 128, heads, head_dim)[:, :kv_len].contiguous()
    return k8, scale[:, :, 0, :, 0].transpose(1, 2).contiguous()


def quantize_attention_v(v, *, compute_dtype=None):
    """ltx_kernels.quantize_attention_v's rule: per (batch, head, channel) the "e4m3_row" rule over
    the channel's S values, written transposed [B, H, D, S_pad] (S_pad = S rounded up to 16), key
    j at column v8_columns(S)[j], the other columns 0. Returns (v8 float8_e4m3fn, v_scale float32
    [B, H, D]). (compute_dtype: unused, the rule is exact in fp32.)"""
    batch, kv_len, heads, head_dim = v.shape
    vt = v.float().permute(0, 2, 3, 1)  # [B, H, D, S]
    if kv_len > 0:
        amax = vt.abs().amax(-1, keepdim=True)
    else:
        amax = vt.new_zeros((batch, heads, head_dim, 1))
    q, scale = _codes(vt, amax, "e4m3_row")
    return _v8_of_keys(q, kv_len), scale.squeeze(-1).contiguous()
