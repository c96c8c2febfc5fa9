"""Fake (meta) implementations of every op, so they trace under torch.compile and torch.export
without touching data. The fake of op <op> is the function `<op>` of this module; `register`
registers them. Each mirrors its C++ op: same output shapes, dtypes and (contiguous) strides, and
the same shape checks, as torch._check errors."""

import functools

import torch
import torch.utils._pytree as pytree

from ._op_namespace import add_op_namespace_prefix


def register(names) -> None:
    """Registers the fake of every op in `names` (all of them: ltx_kernels.OPS)."""
    for name in names:
        torch.library.register_fake(add_op_namespace_prefix(name))(_on_one_device(name))


def _on_one_device(name: str):
    """The fake of op `name` behind the C++ op's check that every tensor is on one device.
    register_fake also makes a fake the op's Meta kernel, which a real call dispatches to when one
    of its tensors is on the meta device (a weight or table never loaded): unchecked, that call
    returned uninitialized memory of x's device instead of an error."""
    fake = globals()[name]

    @functools.wraps(fake)
    def checked(*args, **kwargs):
        leaves = pytree.tree_leaves((args, kwargs))
        devices = {str(t.device) for t in leaves if isinstance(t, torch.Tensor)}
        torch._check(
            len(devices) <= 1,
            lambda: (
                f"ltx_kernels.{name}: all tensors must be on the same device, got "
                f"{', '.join(sorted(devices))}"
            ),
        )
        return fake(*args, **kwargs)

    return checked


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6):
    torch._check(x.dim() >= 1, lambda: "ltx_kernels.rmsnorm: x must have at least 1 dimension")
    if weight is not None:
        torch._check(
            weight.dim() == 1 and weight.shape[0] == x.shape[-1],
            lambda: (
                f"ltx_kernels.rmsnorm: weight must have shape [hidden] = [{x.shape[-1]}], "
                f"got {list(weight.shape)}"
            ),
        )
    return x.new_empty(x.shape, dtype=weight.dtype if weight is not None else x.dtype)


def _check_last_dim(op: str, name: str, t, hidden: int):
    if t is not None:
        torch._check(
            t.dim() >= 1 and t.shape[-1] == hidden,
            lambda: (
                f"ltx_kernels.{op}: {name} must have last dimension {hidden}, "
                f"got shape {list(t.shape)}"
            ),
        )


def rmsnorm_modulate(x, scale, shift, weight=None, eps=1e-6, *, upcast=False):
    for name, t in (("scale", scale), ("shift", shift), ("weight", weight)):
        _check_last_dim("rmsnorm_modulate", name, t, x.shape[-1])
    return x.new_empty(x.shape)


def layernorm_modulate(x, scale, shift, weight=None, bias=None, eps=1e-6, *, upcast=False):
    for name, t in (("scale", scale), ("shift", shift), ("weight", weight), ("bias", bias)):
        _check_last_dim("layernorm_modulate", name, t, x.shape[-1])
    return x.new_empty(x.shape)


def _add_norm_modulate_fake(op, x, y, operands):
    torch._check(y.shape == x.shape, lambda: f"ltx_kernels.{op}: y must have x's shape")
    for name, t in operands:
        _check_last_dim(op, name, t, x.shape[-1])
    return x.new_empty(x.shape), x.new_empty(x.shape)


def add_rmsnorm_modulate(x, y, scale, shift, gate=None, weight=None, eps=1e-6, *, upcast=False):
    return _add_norm_modulate_fake(
        "add_rmsnorm_modulate",
        x,
        y,
        (("scale", scale), ("shift", shift), ("gate", gate), ("weight", weight)),
    )


def add_layernorm_modulate(
    x, y, scale, shift, gate=None, weight=None, bias=None, eps=1e-6, *, upcast=False
):
    return _add_norm_modulate_fake(
        "add_layernorm_modulate",
        x,
        y,
        (("scale", scale), ("shift", shift), ("gate", gate), ("weight", weight), ("bias", bias)),
    )


def gated_residual(x, y, gate=None, *, upcast=False):
    torch._check(y.shape == x.shape, lambda: "ltx_kernels.gated_residual: y must have x's shape")
    _check_last_dim("gated_residual", "gate", gate, x.shape[-1])
    return x.new_empty(x.shape)


def rope(x, cos, sin, interleaved=True):
    return x.new_empty(x.shape)


def qk_rmsnorm_rope(
    q, k, q_weight, k_weight, cos, sin, eps=1e-6, across_heads=True, interleaved=True
):
    torch._check(k.dtype == q.dtype, lambda: "ltx_kernels.qk_rmsnorm_rope: k must have q's dtype")
    return q.new_empty(q.shape), k.new_empty(k.shape)


def gelu(x, approximate="none"):
    return x.new_empty(x.shape)


def geglu(x, approximate="none"):
    torch._check(
        x.shape[-1] % 2 == 0, lambda: "ltx_kernels.geglu: x must have an even last dimension"
    )
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def gelu_backward(grad_out, x, approximate="none"):
    torch._check(
        grad_out.shape == x.shape,
        lambda: "ltx_kernels.gelu_backward: grad_out must have the output's shape",
    )
    return x.new_empty(x.shape)


def geglu_backward(grad_out, x, approximate="none"):
    torch._check(
        x.shape[-1] % 2 == 0,
        lambda: "ltx_kernels.geglu_backward: x must have an even last dimension",
    )
    torch._check(
        grad_out.shape == (*x.shape[:-1], x.shape[-1] // 2),
        lambda: "ltx_kernels.geglu_backward: grad_out must have the output's shape",
    )
    return x.new_empty(x.shape)


def norm_modulate_backward(
    grad_out, grad_h, h, y, gate, scale, shift, weight, bias, eps, layer_norm, output_mask
):
    op = "ltx_kernels.norm_modulate_backward"
    torch._check(
        grad_out is not None or grad_h is not None, lambda: f"{op}: needs grad_out or grad_h"
    )
    torch._check(grad_out is None or h is not None, lambda: f"{op}: grad_out needs h")
    ref = h if grad_out is not None else grad_h
    for name, t in (("grad_out", grad_out), ("grad_h", grad_h), ("y", y)):
        torch._check(
            t is None or t.shape == ref.shape, lambda: f"{op}: {name} must have the rows' shape"
        )
    want_x, want_y, want_gate, want_scale, want_shift, want_weight, want_bias = output_mask
    torch._check(not want_gate or y is not None, lambda: f"{op}: the gradient of gate needs y")

    def operand_grad(wanted, t):  # the operand's shape and dtype
        return t.new_empty(t.shape) if wanted and t is not None else ref.new_empty((0,))

    return (
        ref.new_empty(ref.shape) if want_x else ref.new_empty((0,)),
        ref.new_empty(ref.shape) if want_y else ref.new_empty((0,)),
        operand_grad(want_gate, gate),
        operand_grad(want_scale, scale),
        operand_grad(want_shift and grad_out is not None, shift),
        operand_grad(want_weight, weight),
        operand_grad(want_bias, bias),
    )


def linear_gelu(x, weight, bias=None):
    torch._check(
        weight.dim() == 2 and weight.shape[1] == x.shape[-1],
        lambda: "ltx_kernels.linear_gelu: weight must have shape [N, K] with K = x.shape[-1]",
    )
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def lora_linear(x, weight, bias, lora_a, lora_b, scaling, offsets):
    op = "ltx_kernels.lora_linear"
    torch._check(
        weight.dim() == 2 and weight.shape[1] == x.shape[-1],
        lambda: f"{op}: weight must have shape [N, K] with K = x.shape[-1]",
    )
    torch._check(
        len(lora_a) == len(lora_b) == len(scaling) == len(offsets),
        lambda: f"{op}: lora_a, lora_b, scaling and offsets need one entry per adapter",
    )
    for j, (a, b) in enumerate(zip(lora_a, lora_b)):
        torch._check(
            a.dim() == 2
            and a.shape[1] == x.shape[-1]
            and b.dim() == 2
            and b.shape[1] == a.shape[0],
            lambda: f"{op}: lora_a[{j}] must be [r, K] and lora_b[{j}] [N_j, r]",
        )
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def rope_backward(grad_out, cos, sin, interleaved=True):
    return grad_out.new_empty(grad_out.shape)


def qk_rmsnorm_rope_backward(
    grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved, weight_grads
):
    op = "ltx_kernels.qk_rmsnorm_rope_backward"
    torch._check(grad_q.shape == q.shape, lambda: f"{op}: grad_q must have q's shape")
    torch._check(grad_k.shape == k.shape, lambda: f"{op}: grad_k must have k's shape")

    def weight_grad(wanted, weight):  # the weight's shape and dtype
        return (
            weight.new_empty(weight.shape) if wanted and weight is not None else q.new_empty((0,))
        )

    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        weight_grad(weight_grads[0], q_weight),
        weight_grad(weight_grads[1], k_weight),
    )


# Quantized-output ops: (q of x's shape in the format's code dtype, its scales), after h for the
# add_ ones. "e4m3_row": float8_e4m3fn codes, "i8_row": int8 codes, one fp32 scale per row.
_CODE_DTYPES = {"e4m3_row": torch.float8_e4m3fn, "i8_row": torch.int8}


def _quant_rows(op, x, format):
    torch._check(
        format in _CODE_DTYPES,
        lambda: f"ltx_kernels.{op}: format must be one of {tuple(_CODE_DTYPES)}, got '{format}'",
    )
    return x.new_empty(x.shape, dtype=_CODE_DTYPES[format]), x.new_empty(
        x.shape[:-1], dtype=torch.float32
    )


def rmsnorm_modulate_quant(
    x, scale, shift, weight=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    rmsnorm_modulate(x, scale, shift, weight, eps, upcast=upcast)
    return _quant_rows("rmsnorm_modulate_quant", x, format)


def layernorm_modulate_quant(
    x, scale, shift, weight=None, bias=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    layernorm_modulate(x, scale, shift, weight, bias, eps, upcast=upcast)
    return _quant_rows("layernorm_modulate_quant", x, format)


def add_rmsnorm_modulate_quant(
    x, y, scale, shift, gate=None, weight=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    h, _ = add_rmsnorm_modulate(x, y, scale, shift, gate, weight, eps, upcast=upcast)
    return (h, *_quant_rows("add_rmsnorm_modulate_quant", x, format))


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
    h, _ = add_layernorm_modulate(x, y, scale, shift, gate, weight, bias, eps, upcast=upcast)
    return (h, *_quant_rows("add_layernorm_modulate_quant", x, format))


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
    return (*_quant_rows("qk_rmsnorm_rope_quant", q, format), k.new_empty(k.shape))


def quantize(x, activation="none", approximate="none", *, format="e4m3_row"):
    torch._check(
        activation in ("none", "gelu"),
        lambda: "ltx_kernels.quantize: activation must be 'none' or 'gelu'",
    )
    torch._check(
        approximate in ("none", "tanh"),
        lambda: "ltx_kernels.quantize: approximate must be 'none' or 'tanh'",
    )
    return _quant_rows("quantize", x, format)


def _check_attention_shape(name, t, shape, what, op="attention"):
    torch._check(
        t.dim() == len(shape) and all(a == b for a, b in zip(t.shape, shape) if b is not None),
        lambda: f"ltx_kernels.{op}: {name} must have {what}, got shape {list(t.shape)}",
    )


#: The dtypes the attention ops' operands and outputs take (attention_ops.cpp's checks; CUDA
#: takes float16/bfloat16 operands only: the device rule stays the real op's).
_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_dtype(op, name, t, dtypes):
    torch._check(
        t.dtype in dtypes,
        lambda: f"ltx_kernels.{op}: {name} must be one of {dtypes}, got {t.dtype}",
    )


def _check_key_lengths(op, key_lengths, batch):
    _check_attention_shape("key_lengths", key_lengths, (batch,), "shape [batch]", op)
    _check_dtype(op, "key_lengths", key_lengths, (torch.int32, torch.int64))


def attention(q, k, v, key_lengths=None, scale=None, *, return_lse=False):
    for name, t in (("q", q), ("k", k), ("v", v)):
        torch._check(
            t.dim() == 4,
            lambda: f"ltx_kernels.attention: {name} must be 4-D [batch, seq_len, heads, head_dim]",
        )
        _check_dtype("attention", name, t, _ATTENTION_DTYPES if name == "q" else (q.dtype,))
    batch, q_len, heads, head_dim = q.shape
    _check_attention_shape("k", k, (batch, None, heads, head_dim), "q's batch, heads and head_dim")
    _check_attention_shape("v", v, tuple(k.shape), "k's shape")
    if key_lengths is not None:
        _check_key_lengths("attention", key_lengths, batch)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = q.new_empty((batch, heads, q_len) if return_lse else (0,), dtype=lse_dtype)
    return q.new_empty(q.shape), lse


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
    out_dtype=None,
    return_lse=False,
):
    op = "attention_int8"
    for name, t in (("q8", q8), ("k8", k8), ("v8", v8)):
        torch._check(t.dim() == 4, lambda: f"ltx_kernels.{op}: {name} must be 4-D")
    for name, t, dtype in (("q8", q8, torch.int8), ("k8", k8, torch.int8)):
        _check_dtype(op, name, t, (dtype,))
    _check_dtype(op, "v8", v8, (torch.float8_e4m3fn,))
    for name, t in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        _check_dtype(op, name, t, (torch.float32,))
    torch._check(
        out_dtype is None or out_dtype in _ATTENTION_DTYPES,
        lambda: f"ltx_kernels.{op}: out_dtype must be one of {_ATTENTION_DTYPES}, got {out_dtype}",
    )
    batch, q_len, heads, head_dim = q8.shape
    kv_len = k8.shape[1]
    blocks = (kv_len + 127) // 128
    _check_attention_shape("k8", k8, (batch, None, heads, head_dim), "q8's batch, heads, D", op)
    _check_attention_shape("v8", v8, (batch, heads, head_dim, None), "[B, H, D, Sk_pad]", op)
    torch._check(
        v8.shape[3] >= (kv_len + 15) // 16 * 16,
        lambda: f"ltx_kernels.{op}: v8.shape[3] must be >= Sk rounded up to 16",
    )
    _check_attention_shape("q_scale", q_scale, (batch, q_len, heads), "shape [B, Sq, H]", op)
    _check_attention_shape("k_scale", k_scale, (batch, heads, blocks), "[B, H, ceil(Sk/128)]", op)
    _check_attention_shape("v_scale", v_scale, (batch, heads, head_dim), "shape [B, H, D]", op)
    if key_lengths is not None:
        _check_key_lengths(op, key_lengths, batch)
    dtype = torch.bfloat16 if out_dtype is None else out_dtype
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse = q8.new_empty((batch, heads, q_len) if return_lse else (0,), dtype=lse_dtype)
    return q8.new_empty(q8.shape, dtype=dtype), lse


def _check_attention_quant_input(op, x):
    torch._check(
        x.dim() == 4,
        lambda: f"ltx_kernels.{op}: its input must be 4-D [batch, seq_len, heads, head_dim]",
    )
    _check_dtype(op, "its input", x, (torch.float16, torch.bfloat16, torch.float32))


def quantize_attention_k(k):
    _check_attention_quant_input("quantize_attention_k", k)
    batch, kv_len, heads, _ = k.shape
    blocks = (kv_len + 127) // 128
    return k.new_empty(k.shape, dtype=torch.int8), k.new_empty(
        (batch, heads, blocks), dtype=torch.float32
    )


def quantize_attention_v(v):
    _check_attention_quant_input("quantize_attention_v", v)
    batch, kv_len, heads, head_dim = v.shape
    kv_pad = (kv_len + 15) // 16 * 16
    return v.new_empty((batch, heads, head_dim, kv_pad), dtype=torch.float8_e4m3fn), v.new_empty(
        (batch, heads, head_dim), dtype=torch.float32
    )
