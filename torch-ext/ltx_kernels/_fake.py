"""Fake (meta) implementations of every op, so they trace under torch.compile and torch.export
without touching data. The fake of op <op> is the function `<op>` of this module; `register`
registers them. Each mirrors its C++ op: same output shapes, dtypes and (contiguous) strides, and
the same shape checks and the same dtype, eps and argument rules, as torch._check errors with the
real op's message (dtypes spelled as torch spells them): under torch.compile a fake runs at trace
time, and one that took what its op refuses would let a graph be built that fails when it runs."""

import functools
import math
import struct

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


# --- The real ops' dtype and scalar rules (binding_utils.h's check_float, kernel_src/checks.c) ---

_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MODEL_DTYPE_NAMES = "float32, float16 or bfloat16"


def _dtype_name(dtype) -> str:
    """A dtype as torch spells it, without "torch." ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def _check_float(op, name, t, float64):
    """binding_utils.h's check_float: t is float32, float16 or bfloat16; with float64 (an op whose C
    twin computes in double, for gradcheck) also float64, which only the CPU takes (no CUDA kernel
    computes in double; a meta tensor stands for a tensor of any device)."""
    double = float64 and t.dtype == torch.float64
    torch._check(
        not double or t.device.type in ("cpu", "meta"),
        lambda: (
            f"ltx_kernels.{op}: {name} is float64, which only the CPU backend takes (for "
            f"gradcheck); on {t.device} use float32, float16 or bfloat16"
        ),
    )
    floats = "float32, float16, bfloat16 or (CPU) float64" if float64 else _MODEL_DTYPE_NAMES
    torch._check(
        double or t.dtype in _MODEL_DTYPES,
        lambda: f"ltx_kernels.{op}: {name} must be {floats}, got {_dtype_name(t.dtype)}",
    )


#: The launchers' rules for an operand's dtype given x's (checks.c): rule -> (the dtypes it takes,
#: what its error says the operand must be).
_OPERAND_RULES = {
    "x": (lambda x: (x,), "have {x_name}'s dtype {x}"),
    "x|fp32": (lambda x: (x, torch.float32), "be {x} or float32"),
    # (upcast=False: every step rounds to x's dtype; fp32 operands take upcast=True)
    "model": (
        lambda x: (x,),
        "have {x_name}'s dtype {x} (pass upcast=True to compute in float32 with a float32 {name})",
    ),
}


def _check_dtype_of(op, name, t, ref_name, ref, rule="x"):
    """t's dtype follows `rule` (_OPERAND_RULES) against ref's dtype."""
    allowed, must = _OPERAND_RULES[rule]
    torch._check(
        t.dtype in allowed(ref.dtype),
        lambda: (
            f"ltx_kernels.{op}: {name} must "
            + must.format(x_name=ref_name, x=_dtype_name(ref.dtype), name=name)
            + f", got {_dtype_name(t.dtype)}"
        ),
    )


def _check_float_op(op, x, operands=(), *, x_name="x", float64=True, any_float64=False):
    """The dtype rules of a float op, walking its tensors once: x (named x_name) and each present
    operand (name, tensor or None, rule) are float32, float16 or bfloat16, or float64 (on the CPU
    only) where the real op takes it: x with float64 (the ops whose C twin computes in double; not
    the quantizing ops); an operand with a float64 x, or with any_float64 (the backward ops) with
    any x. Then each operand's launcher rule against x's dtype (_OPERAND_RULES; None: none)."""
    _check_float(op, x_name, x, float64)
    operand_float64 = any_float64 or (float64 and x.dtype == torch.float64)
    for name, t, rule in operands:
        if t is None:
            continue
        _check_float(op, name, t, operand_float64)
        if rule is not None:
            _check_dtype_of(op, name, t, x_name, x, rule)


def _check_same_dtype(op, operands):
    """The present operands (name, tensor or None) have one dtype, the first's (checks.c's
    SAME_DTYPE_AS rule: the modulation tensors, cos and sin)."""
    present = [(name, t) for name, t in operands if t is not None]
    for name, t in present[1:]:
        ref_name, ref = present[0]
        torch._check(
            t.dtype == ref.dtype,
            lambda: (
                f"ltx_kernels.{op}: {name} must have the dtype of {ref_name} "
                f"({_dtype_name(ref.dtype)}), got {_dtype_name(t.dtype)}"
            ),
        )


def _check_eps(op, eps):
    """checks.c's eps_rule on eps as the launchers take it, a C float: finite and >= 0 (NaN is
    not; a double beyond the float range is inf)."""
    try:
        eps = struct.unpack("f", struct.pack("f", eps))[0]
    except OverflowError:
        eps = math.copysign(math.inf, eps)
    torch._check(
        0 <= eps < math.inf, lambda: f"ltx_kernels.{op}: eps must be finite and >= 0, got {eps:g}"
    )


def _check_approximate(op, approximate):
    """GELU's approximate: the real op's two (elementwise_ops.cpp's gelu_approximate)."""
    torch._check(
        approximate in ("none", "tanh"),
        lambda: f"ltx_kernels.{op}: approximate must be 'none' or 'tanh', got '{approximate}'",
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6):
    # (the weight: any model dtype; a float64 x takes a float64 one)
    weight_rule = "x" if x.dtype == torch.float64 else None
    _check_float_op("rmsnorm", x, (("weight", weight, weight_rule),))
    torch._check(x.dim() >= 1, lambda: "ltx_kernels.rmsnorm: x must have at least 1 dimension")
    if weight is not None:
        torch._check(
            weight.dim() == 1 and weight.shape[0] == x.shape[-1],
            lambda: (
                f"ltx_kernels.rmsnorm: weight must have shape [hidden] = [{x.shape[-1]}], "
                f"got {list(weight.shape)}"
            ),
        )
    _check_eps("rmsnorm", eps)
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


def _norm_modulate(
    op, x, y, scale, shift, gate=None, weight=None, bias=None, *, eps, upcast, quant=False
):
    """The checks of the (residual +) norm + modulation ops (norm_ops.cpp's norm_modulate,
    checks.c's ltx_check_norm_modulate): y of x's shape and dtype; scale, shift, gate, weight and
    bias of x's last dim and dtype, or float32 with upcast, the modulation of one dtype; float64 on
    the CPU, but not quantized; eps. Returns the outputs' (h, n) of x's shape and dtype."""
    rule = "x|fp32" if upcast else "model"
    operands = (("scale", scale), ("shift", shift), ("gate", gate), ("weight", weight))
    operands += (("bias", bias),)
    _check_float_op(op, x, (("y", y, "x"), *((n, t, rule) for n, t in operands)), float64=not quant)
    _check_same_dtype(op, operands[:3])
    if y is not None:
        torch._check(y.shape == x.shape, lambda: f"ltx_kernels.{op}: y must have x's shape")
    for name, t in operands:
        _check_last_dim(op, name, t, x.shape[-1])
    _check_eps(op, eps)
    return x.new_empty(x.shape), x.new_empty(x.shape)


def rmsnorm_modulate(x, scale, shift, weight=None, eps=1e-6, *, upcast=False):
    op = "rmsnorm_modulate"
    return _norm_modulate(op, x, None, scale, shift, weight=weight, eps=eps, upcast=upcast)[1]


def layernorm_modulate(x, scale, shift, weight=None, bias=None, eps=1e-6, *, upcast=False):
    return _norm_modulate(
        "layernorm_modulate", x, None, scale, shift, None, weight, bias, eps=eps, upcast=upcast
    )[1]


def add_rmsnorm_modulate(x, y, scale, shift, gate=None, weight=None, eps=1e-6, *, upcast=False):
    return _norm_modulate(
        "add_rmsnorm_modulate", x, y, scale, shift, gate, weight, eps=eps, upcast=upcast
    )


def add_layernorm_modulate(
    x, y, scale, shift, gate=None, weight=None, bias=None, eps=1e-6, *, upcast=False
):
    return _norm_modulate(
        "add_layernorm_modulate", x, y, scale, shift, gate, weight, bias, eps=eps, upcast=upcast
    )


def gated_residual(x, y, gate=None, *, upcast=False):
    op = "gated_residual"
    _check_float_op(op, x, (("y", y, "x"), ("gate", gate, "x|fp32" if upcast else "model")))
    torch._check(y.shape == x.shape, lambda: "ltx_kernels.gated_residual: y must have x's shape")
    _check_last_dim(op, "gate", gate, x.shape[-1])
    return x.new_empty(x.shape)


def _rope_tables(cos, sin):
    """The (name, tensor, rule) of the RoPE tables: x's dtype or float32."""
    return (("cos", cos, "x|fp32"), ("sin", sin, "x|fp32"))


def rope(x, cos, sin, interleaved=True):
    _check_float_op("rope", x, _rope_tables(cos, sin))
    _check_same_dtype("rope", (("cos", cos), ("sin", sin)))
    return x.new_empty(x.shape)


def _qk_rmsnorm_rope(op, q, k, q_weight, k_weight, cos, sin, eps, *, float64=True, grads=()):
    """The dtype rules of qk_rmsnorm_rope, its quantized form (no float64) and its backward (the
    gradients `grads` as further operands, float64 operands of any float x): k of q's dtype, the
    weights and tables q's dtype or float32, cos and sin of one dtype; eps."""
    operands = (("k", k, "x"), ("q_weight", q_weight, "x|fp32"), ("k_weight", k_weight, "x|fp32"))
    _check_float_op(
        op,
        q,
        (*operands, *_rope_tables(cos, sin), *grads),
        x_name="q",
        float64=float64,
        any_float64=bool(grads),
    )
    _check_same_dtype(op, (("cos", cos), ("sin", sin)))
    _check_eps(op, eps)


def qk_rmsnorm_rope(
    q, k, q_weight, k_weight, cos, sin, eps=1e-6, across_heads=True, interleaved=True
):
    _qk_rmsnorm_rope("qk_rmsnorm_rope", q, k, q_weight, k_weight, cos, sin, eps)
    return q.new_empty(q.shape), k.new_empty(k.shape)


def gelu(x, approximate="none"):
    _check_float_op("gelu", x)
    _check_approximate("gelu", approximate)
    return x.new_empty(x.shape)


def geglu(x, approximate="none"):
    _check_float_op("geglu", x)
    _check_approximate("geglu", approximate)
    torch._check(
        x.shape[-1] % 2 == 0, lambda: "ltx_kernels.geglu: x must have an even last dimension"
    )
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _gelu_backward(op, grad_out, x, approximate):
    _check_float_op(op, x, (("grad_out", grad_out, "x"),), any_float64=True)
    _check_approximate(op, approximate)


def gelu_backward(grad_out, x, approximate="none"):
    _gelu_backward("gelu_backward", grad_out, x, approximate)
    torch._check(
        grad_out.shape == x.shape,
        lambda: "ltx_kernels.gelu_backward: grad_out must have the output's shape",
    )
    return x.new_empty(x.shape)


def geglu_backward(grad_out, x, approximate="none"):
    _gelu_backward("geglu_backward", grad_out, x, approximate)
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
    want_x, want_y, want_gate, want_scale, want_shift, want_weight, want_bias = output_mask
    # The rows' tensors of ref's dtype; gate, and with grad_out (the norm's gradients) scale,
    # weight and bias, of ref's dtype or float32 (gate and scale of one); shift (its gradient is
    # grad_out's rows in shift's dtype) any float. float64 operands with any float rows.
    norm = grad_out is not None
    _check_float_op(
        "norm_modulate_backward",
        ref,
        (
            ("grad_out", grad_out, "x"),
            ("grad_h", grad_h, "x"),
            ("y", y, "x"),
            ("gate", gate, "x|fp32"),
            ("scale", scale if norm else None, "x|fp32"),
            ("shift", shift if want_shift else None, None),
            ("weight", weight if norm else None, "x|fp32"),
            ("bias", bias if norm else None, "x|fp32"),
        ),
        x_name="h" if norm else "grad_h",
        any_float64=True,
    )
    _check_same_dtype(
        "norm_modulate_backward", (("scale", scale if norm else None), ("gate", gate))
    )
    if norm:
        _check_eps("norm_modulate_backward", eps)
    for name, t in (("grad_out", grad_out), ("grad_h", grad_h), ("y", y)):
        torch._check(
            t is None or t.shape == ref.shape, lambda: f"{op}: {name} must have the rows' shape"
        )
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


def _check_linear(op, x, weight, bias):
    """linear_ops.cpp's check_linear: weight [N, K] with K = x.shape[-1] and bias [N], of x's
    dtype; x float (float64 on the CPU)."""
    _check_float_op(op, x)
    torch._check(
        weight.dim() == 2 and weight.shape[1] == x.shape[-1],
        lambda: f"ltx_kernels.{op}: weight must have shape [N, K] with K = x.shape[-1]",
    )
    _check_dtype_of(op, "weight", weight, "x", x)
    if bias is not None:
        _check_dtype_of(op, "bias", bias, "x", x)


def linear_gelu(x, weight, bias=None):
    _check_linear("linear_gelu", x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def lora_linear(x, weight, bias, lora_a, lora_b, scaling, offsets):
    op = "ltx_kernels.lora_linear"
    _check_linear("lora_linear", x, weight, bias)
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
        torch._check(
            a.dtype == x.dtype and b.dtype == x.dtype,
            lambda: (
                f"{op}: lora_a[{j}] and lora_b[{j}] must have x's dtype {_dtype_name(x.dtype)}, "
                f"got {_dtype_name(a.dtype)} and {_dtype_name(b.dtype)}"
            ),
        )
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def rope_backward(grad_out, cos, sin, interleaved=True):
    op = "rope_backward"
    _check_float_op(op, grad_out, _rope_tables(cos, sin), x_name="grad_out", any_float64=True)
    _check_same_dtype(op, (("cos", cos), ("sin", sin)))
    return grad_out.new_empty(grad_out.shape)


def qk_rmsnorm_rope_backward(
    grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, across_heads, interleaved, weight_grads
):
    op = "ltx_kernels.qk_rmsnorm_rope_backward"
    grads = (("grad_q", grad_q, "x"), ("grad_k", grad_k, None))
    _qk_rmsnorm_rope(
        "qk_rmsnorm_rope_backward", q, k, q_weight, k_weight, cos, sin, eps, grads=grads
    )
    _check_dtype_of("qk_rmsnorm_rope_backward", "grad_k", grad_k, "k", k)
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
# add_ ones. "e4m3_row": float8_e4m3fn codes, "i8_row": int8 codes, one fp32 scale per row. Their
# inputs are float32, float16 or bfloat16 (no float64: the codes are of the model-dtype value).
_CODE_DTYPES = {"e4m3_row": torch.float8_e4m3fn, "i8_row": torch.int8}


def _quant_rows(op, x, format):
    torch._check(
        format in _CODE_DTYPES,
        lambda: (
            f"ltx_kernels.{op}: format must be "
            + " or ".join(f"'{name}'" for name in _CODE_DTYPES)
            + f", got '{format}'"
        ),
    )
    return x.new_empty(x.shape, dtype=_CODE_DTYPES[format]), x.new_empty(
        x.shape[:-1], dtype=torch.float32
    )


def rmsnorm_modulate_quant(
    x, scale, shift, weight=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    op = "rmsnorm_modulate_quant"
    _norm_modulate(op, x, None, scale, shift, weight=weight, eps=eps, upcast=upcast, quant=True)
    return _quant_rows(op, x, format)


def layernorm_modulate_quant(
    x, scale, shift, weight=None, bias=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    op = "layernorm_modulate_quant"
    _norm_modulate(
        op, x, None, scale, shift, None, weight, bias, eps=eps, upcast=upcast, quant=True
    )
    return _quant_rows(op, x, format)


def add_rmsnorm_modulate_quant(
    x, y, scale, shift, gate=None, weight=None, eps=1e-6, *, upcast=False, format="e4m3_row"
):
    op = "add_rmsnorm_modulate_quant"
    h, _ = _norm_modulate(op, x, y, scale, shift, gate, weight, eps=eps, upcast=upcast, quant=True)
    return (h, *_quant_rows(op, x, format))


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
    op = "add_layernorm_modulate_quant"
    h, _ = _norm_modulate(
        op, x, y, scale, shift, gate, weight, bias, eps=eps, upcast=upcast, quant=True
    )
    return (h, *_quant_rows(op, x, format))


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
    op = "qk_rmsnorm_rope_quant"
    _qk_rmsnorm_rope(op, q, k, q_weight, k_weight, cos, sin, eps, float64=False)
    return (*_quant_rows(op, q, format), k.new_empty(k.shape))


def quantize(x, activation="none", approximate="none", *, format="e4m3_row"):
    _check_float_op("quantize", x, float64=False)
    torch._check(
        activation in ("none", "gelu"),
        lambda: f"ltx_kernels.quantize: activation must be 'none' or 'gelu', got '{activation}'",
    )
    _check_approximate("quantize", approximate)
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
