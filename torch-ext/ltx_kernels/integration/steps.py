"""The fused steps the patched blocks are built from. Each step takes the enabled op names and the
diffusers modules it replaces; it runs our op when the op is enabled and the operands are in a form
the op reproduces exactly (dtypes, no hook on the modules whose weights it reads, a module of the
expected kind), and otherwise runs the diffusers code for that step. Rounding matches the eager
code: model-dtype steps round every operation (upcast=False), Wan's fp32 steps round once.

While autograd records through a step (training), the step uses only ops in FUSED_BACKWARD
(FUSED_BACKWARD_COMPILED under torch.compile) and runs the diffusers code for the others, so
training gets stock gradients at stock speed or faster.

Quantized activations (inject_optimized_kernels(..., fp8=True)): a norm step whose output feeds
only modules that take quantized rows gets their format (`quant`, which the block asks its
consumers for: quant.input_format) and returns that output as quant.QuantRows, quantized by the
quantized form of its op in the same pass; those modules take it as is. Where the op does not run
(disabled, operands it cannot take) the step returns the tensor and each consumer quantizes it
itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import (
    add_layernorm_modulate,
    add_layernorm_modulate_quant,
    add_rmsnorm_modulate,
    add_rmsnorm_modulate_quant,
    gated_residual,
    geglu,
    gelu,
    layernorm_modulate,
    layernorm_modulate_quant,
    linear_gelu,
    qk_rmsnorm_rope,
    qk_rmsnorm_rope_quant,
    rmsnorm,
    rmsnorm_modulate,
    rmsnorm_modulate_quant,
    rope,
)
from .injector import FUSED_BACKWARD, FUSED_BACKWARD_COMPILED, FusedAttnProcessor
from .linears import Fp8Linear, is_peft_lora, lora_outputs, projections
from .module_checks import has_hooks, plain_tensor
from .quant import QuantRows, input_format, quantize_rows, rows_of


def ops_for_step(ops, *operands):
    """The ops a step may use: the enabled ones, or, while autograd records through the step (grad
    mode on and an operand requires grad: a tensor, a (cos, sin) pair, or a module's weight or
    bias), those in FUSED_BACKWARD (FUSED_BACKWARD_COMPILED under torch.compile). None when a
    tensor operand's last dimension is strided (the ops read rows with unit stride; e.g.
    HunyuanVideo's patch embedding hands its first block a transposed view): the step then runs
    the diffusers code."""
    requires_grad = _walk_operands(operands, torch.is_grad_enabled())
    if requires_grad is None:
        return frozenset()
    if requires_grad:
        compiling = torch.compiler.is_compiling()
        return ops & (FUSED_BACKWARD_COMPILED if compiling else FUSED_BACKWARD)
    return ops


def _walk_operands(operands, recording: bool) -> bool | None:
    """One pass over the tensors among `operands` (the members of tuples and lists among them, the
    weight and bias of the modules among them): None as soon as one has a strided last dimension,
    else whether autograd is `recording` and one of them requires grad. (Called by every step on
    every call: plain loops, and a module's parameters read from its _parameters where they are.)"""
    requires_grad = False
    for operand in operands:
        if isinstance(operand, torch.nn.Module):
            operand = (_module_tensor(operand, "weight"), _module_tensor(operand, "bias"))
        if isinstance(operand, torch.Tensor):
            if operand.dim() > 0 and operand.stride(-1) != 1 and operand.size(-1) > 1:
                return None
            requires_grad = requires_grad or (recording and operand.requires_grad)
        elif isinstance(operand, (tuple, list)):
            inner = _walk_operands(operand, recording)
            if inner is None:
                return None
            requires_grad = requires_grad or inner
    return requires_grad


def _module_tensor(module: torch.nn.Module, name: str):
    """getattr(module, name, None), from the module's parameters first (nn.Module.__getattr__'s
    own first place, without its call)."""
    parameters = module._parameters
    return parameters[name] if name in parameters else getattr(module, name, None)


def _plain(*modules) -> bool:
    """Hook-free modules (no replaced forward, no registered forward hooks: a hook sees the module
    run as itself) whose weight and bias (where they have them) are plain tensors."""
    return all(
        m is not None
        and not has_hooks(m)
        and plain_tensor(getattr(m, "weight", None))
        and plain_tensor(getattr(m, "bias", None))
        for m in modules
    )


def _bf16_linear(m) -> bool:
    """An nn.Linear whose weight the fused ops may read (not an Fp8Linear's: parked or freed)."""
    return isinstance(m, torch.nn.Linear) and not isinstance(m, Fp8Linear)


def _same_dtype(x: torch.Tensor, *tensors) -> bool:
    return all(t is None or t.dtype == x.dtype for t in tensors)


def is_diffusers_rmsnorm(norm) -> bool:
    return (
        type(norm).__name__ == "RMSNorm"
        and not isinstance(norm, torch.nn.RMSNorm)
        and getattr(norm, "bias", None) is None
    )


def is_plain_layernorm(norm) -> bool:
    return isinstance(norm, torch.nn.LayerNorm) and len(norm.normalized_shape) == 1


def _modulation_ok(x, norm, scale, shift, gate=None, upcast=False) -> bool:
    """The operands the model-dtype form of an op accepts (upcast: fp32 or x's dtype)."""
    weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
    if upcast:
        return all(
            t is None or t.dtype in (x.dtype, torch.float32)
            for t in (scale, shift, gate, weight, bias)
        )
    return _same_dtype(x, scale, shift, gate, weight, bias)


# ------------------------------------------------------------------------------------------------
# Norms
# ------------------------------------------------------------------------------------------------
def diffusers_rmsnorm(ops, norm, x):
    """diffusers RMSNorm (any weight dtype; its double rounding with a 16-bit weight) in one
    launch, e.g. the per-head q/k norm of SD3.5 and HunyuanVideo."""
    ops = ops_for_step(ops, x, norm)
    if "rmsnorm" in ops and _plain(norm) and is_diffusers_rmsnorm(norm):
        return rmsnorm(x, norm.weight, norm.eps)
    return norm(x)


# ------------------------------------------------------------------------------------------------
# Norm + modulation (AdaLN): n = norm(x) * (1 + scale) + shift
# ------------------------------------------------------------------------------------------------
def norm_modulate(ops, norm, x, scale, shift, quant: str | None = None):
    """diffusers RMSNorm or nn.LayerNorm of x, modulated, in x's dtype (quant: a format, as
    QuantRows where the op runs)."""
    ops = ops_for_step(ops, x, norm, scale, shift)
    if _plain(norm) and _modulation_ok(x, norm, scale, shift):
        if "rmsnorm_modulate" in ops and is_diffusers_rmsnorm(norm):
            op = _producer(rmsnorm_modulate, rmsnorm_modulate_quant, quant)
            return op(x, scale, shift, norm.weight, norm.eps)
        if "layernorm_modulate" in ops and is_plain_layernorm(norm):
            op = _producer(layernorm_modulate, layernorm_modulate_quant, quant)
            return op(x, scale, shift, norm.weight, norm.bias, norm.eps)
    return norm(x) * (1 + scale) + shift


def _producer(op, quantized_op, quant: str | None):
    """op, or with a format its quantized form returning QuantRows (after h for the add_ ops)."""
    if quant is None:
        return op
    return lambda *args, **kwargs: rows_of(quant, quantized_op(*args, **kwargs, format=quant))


def _fp32_norm_fusable(norm, x, scale=None, shift=None, gate=None) -> bool:
    """norm is a hook-free nn.LayerNorm (FP32LayerNorm) and the modulation tensors are None or of
    one dtype (fp32 or x's), as the upcast ops take them."""
    dtypes = {t.dtype for t in (scale, shift, gate) if t is not None}
    return (
        _plain(norm)
        and is_plain_layernorm(norm)
        and len(dtypes) <= 1
        and _modulation_ok(x, norm, scale, shift, gate, upcast=True)
    )


def norm_modulate_fp32(ops, norm, x, scale=None, shift=None, quant: str | None = None):
    """Wan: `(norm(x.float()) * (1 + scale) + shift).type_as(x)` with an fp32 LayerNorm, or
    `norm(x.float()).type_as(x)` without modulation (Wan's norm2); quant: as QuantRows where the
    op runs."""
    ops = ops_for_step(ops, x, norm, scale, shift)
    if "layernorm_modulate" in ops and _fp32_norm_fusable(norm, x, scale, shift):
        op = _producer(layernorm_modulate, layernorm_modulate_quant, quant)
        return op(x, scale, shift, norm.weight, norm.bias, norm.eps, upcast=True)
    n = norm(x.float())  # nn.Identity for Wan's norm2 without cross_attn_norm
    if scale is not None:
        n = n * (1 + scale) + shift
    return n.type_as(x)


def add_norm_modulate_fp32(
    ops, norm, x, y, scale=None, shift=None, gate=None, quant: str | None = None
):
    """The upcast twin of add_norm_modulate (Wan), each output rounded once. Returns (h, n):
    h = (x.float() + y * gate).type_as(x), or x + y without gate; n = norm_modulate_fp32(h)
    (quant: as QuantRows where the op runs)."""
    ops = ops_for_step(ops, x, y, norm, scale, shift, gate)
    if (
        "add_layernorm_modulate" in ops
        and _same_dtype(x, y)
        and _fp32_norm_fusable(norm, x, scale, shift, gate)
    ):
        op = _producer(add_layernorm_modulate, add_layernorm_modulate_quant, quant)
        return op(x, y, scale, shift, gate, norm.weight, norm.bias, norm.eps, upcast=True)
    h = x + y if gate is None else residual_fp32(ops, x, y, gate)
    return h, norm_modulate_fp32(ops, norm, h, scale, shift, quant)


def add_norm_modulate(ops, norm, x, y, scale, shift, gate=None, quant: str | None = None):
    """h = x + y * gate (x + y without gate); n = norm(h) * (1 + scale) + shift. Returns (h, n)
    (quant: n as QuantRows where the op runs)."""
    ops = ops_for_step(ops, x, y, norm, scale, shift, gate)
    if _plain(norm) and _modulation_ok(x, norm, scale, shift, gate) and _same_dtype(x, y):
        if "add_rmsnorm_modulate" in ops and is_diffusers_rmsnorm(norm):
            op = _producer(add_rmsnorm_modulate, add_rmsnorm_modulate_quant, quant)
            return op(x, y, scale, shift, gate, norm.weight, norm.eps)
        if "add_layernorm_modulate" in ops and is_plain_layernorm(norm):
            op = _producer(add_layernorm_modulate, add_layernorm_modulate_quant, quant)
            return op(x, y, scale, shift, gate, norm.weight, norm.bias, norm.eps)
    h = residual(ops, x, y, gate)
    return h, norm_modulate(ops, norm, h, scale, shift, quant)


# ------------------------------------------------------------------------------------------------
# Residuals
# ------------------------------------------------------------------------------------------------
def residual(ops, x, y, gate=None):
    """x + y * gate (x + y without gate), every step in x's dtype."""
    ops = ops_for_step(ops, x, y, gate)
    if "gated_residual" in ops and _same_dtype(x, y, gate):
        return gated_residual(x, y, gate)
    return x + y * gate if gate is not None else x + y


def modulation(ops, table, temb, batch_size: int) -> tuple[torch.Tensor, ...]:
    """The modulation parameters of an LTX-Video / LTX-2 block, `(table[None, None] + temb.reshape(
    B, S, n, D)).unbind(2)` for its [n, D] scale_shift_table, as diffusers computes them. Per token
    (S > 1: LTXConditionPipeline, image-to-video) the sum is [B, S, n, D], as large as the block's
    activations times n, and torch's broadcasting add writes it at half the copy bandwidth (42 ms
    of an LTX-Video 13B step on the H100): it runs on gated_residual instead, x + gate * y with x
    = temb, gate = the table (one row, broadcast) and y = ones (a stride-0 row): the same sum
    rounded once, at copy speed."""
    table = table.to(temb.device)
    values = temb.reshape(batch_size, temb.shape[1], *table.shape)
    ops = ops_for_step(ops, temb, table)
    if "gated_residual" in ops and values.shape[1] > 1 and _same_dtype(temb, table):
        flat = values.flatten(2)
        ones = torch.ones_like(table).reshape(-1).expand_as(flat)
        values = gated_residual(flat, ones, table.reshape(-1)).view(values.shape)
    else:
        values = table[None, None] + values
    return values.unbind(dim=2)


def residual_fp32(ops, x, y, gate):
    """Wan: `(x.float() + y * gate).type_as(x)` with an fp32 gate, rounded once."""
    ops = ops_for_step(ops, x, y, gate)
    if "gated_residual" in ops and _same_dtype(x, y) and gate.dtype in (x.dtype, torch.float32):
        return gated_residual(x, y, gate, upcast=True)
    return (x.float() + y * gate).type_as(x)


# ------------------------------------------------------------------------------------------------
# Attention: q/k/v projections
# ------------------------------------------------------------------------------------------------
QKV = ("to_q", "to_k", "to_v")


ADDED_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")  # a joint attention's text stream


def fused_projections(ops, attn, x, key: str = "qkv", names=QKV):
    """attn.to_q(x), attn.to_k(x), attn.to_v(x) (or the modules `names`) as one GEMM over the
    weights injection fused, with their LoRA adapters in the same lora_linear call
    (linears.projections), where it can; x may be QuantRows."""
    lora_ok = "lora_linear" in ops_for_step(ops, x)
    return projections(attn, key, names, x, "fused_projections" in ops, lora_ok)


def linear(ops, module, x):
    """module(x) for a projection module: a peft LoRA Linear runs as one lora_linear call where
    it can (linears.lora_outputs), anything else as itself."""
    if is_peft_lora(module) and "lora_linear" in ops_for_step(ops, x):
        out = lora_outputs([module], x)
        if out is not None:
            return out[0]
    return module(x)


def attention(attn, *args, **kwargs):
    """attn(*args, **kwargs) of a diffusers attention module (LTX, FLUX, Wan: hidden_states,
    encoder_hidden_states, attention_mask, rotary, which their forward passes to the processor in
    this order; LTX-2: its keywords, ltx2._attention), calling our processor directly with the
    same arguments when nothing hooks attn: the module's forward only filters keyword arguments,
    through inspect.signature of its processor on every call, which costs more host time than a
    2688-token attention's kernels take to launch. hidden_states may be QuantRows
    (quant.input_format(..., through=attn))."""
    if isinstance(attn.processor, FusedAttnProcessor) and not has_hooks(attn):
        return attn.processor(attn, *args, **kwargs)
    return attn(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# Attention: q/k RMSNorm + RoPE
# ------------------------------------------------------------------------------------------------
def _rmsnorm_eps(norm, x):
    return norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps


def fuses_qk_norm(ops, norm_q, norm_k, q, k) -> bool:
    """Whether qk_norm_rope runs the q/k norms in our op: a hook-free torch.nn.RMSNorm pair with one
    eps, q and k of one dtype, weights in it or fp32."""
    return (
        "qk_rmsnorm_rope" in ops
        and isinstance(norm_q, torch.nn.RMSNorm)
        and isinstance(norm_k, torch.nn.RMSNorm)
        and _plain(norm_q, norm_k)
        and _rmsnorm_eps(norm_q, q) == _rmsnorm_eps(norm_k, k)
        and q.dtype == k.dtype
        and _weights_ok(q, norm_q.weight, norm_k.weight)
    )


def qk_norm_rope(
    ops,
    norm_q,
    norm_k,
    q,
    k,
    cos_sin,
    diffusers_rope,
    *,
    across_heads: bool,
    interleaved: bool = True,
    query_format: str | None = None,
):
    """q, k = norm_q(q), norm_k(k) (torch.nn.RMSNorm; None: no norm), then RoPE with
    cos_sin = (cos, sin) or None. diffusers_rope(t, cos_sin) is the model's own rotation, used when
    the rope op is disabled or cannot take the tables. With a query_format (attention.query_format:
    the attention quantizes q in it), q comes back quantized in that format (QuantRows, from
    qk_rmsnorm_rope_quant's pass) where our op runs the whole step; a tensor otherwise."""
    ops = ops_for_step(ops, q, k, norm_q, norm_k, cos_sin)
    rotate = cos_sin is not None and "rope" in ops and _same_rope_tables(q, cos_sin)
    fused_norm = fuses_qk_norm(ops, norm_q, norm_k, q, k)
    if fused_norm:
        cos, sin = cos_sin if rotate else (None, None)
        args = (q, k, norm_q.weight, norm_k.weight, cos, sin, _rmsnorm_eps(norm_q, q))
        if query_format is not None and (cos_sin is None or rotate):
            *q_rows, k = qk_rmsnorm_rope_quant(
                *args, across_heads, interleaved, format=query_format
            )
            return QuantRows(*q_rows, query_format), k
        q, k = qk_rmsnorm_rope(*args, across_heads, interleaved)
    else:
        if norm_q is not None:
            q = norm_q(q)
        if norm_k is not None:
            k = norm_k(k)
        if rotate:
            q, k = rope(q, *cos_sin, interleaved), rope(k, *cos_sin, interleaved)
    if cos_sin is not None and not rotate:
        q, k = diffusers_rope(q, cos_sin), diffusers_rope(k, cos_sin)
    return q, k


def rope_over_tokens(rope):
    """A model's rotation over whole tokens, rope(t [B, S, C], cos_sin), as qk_norm_rope_heads'
    diffusers_rope takes it: of x [B, S, H, Dh] with tables split the same way."""

    def over_heads(x, cos_sin):
        whole = rope(x.flatten(2), tuple(t.flatten(2) for t in cos_sin))
        return whole.unflatten(2, x.shape[2:])

    return over_heads


def qk_norm_rope_heads(
    ops, norm_q, norm_k, q, k, heads: int, cos_sin, diffusers_rope, query_format=None
):
    """qk_norm_rope of q/k [B, S, C] whose norms (torch.nn.RMSNorm over C) span the token, returned
    split into `heads` ([B, S, H, Dh]; cos_sin and diffusers_rope take the split tensors): our op
    norms the split q/k across the heads, and with a query_format quantizes q per token and head.
    Where it does not run the norms, they run on the whole tokens first (the shared step would
    norm each head)."""
    if not fuses_qk_norm(ops_for_step(ops, q, k, norm_q, norm_k, cos_sin), norm_q, norm_k, q, k):
        q, k, norm_q, norm_k = norm_q(q), norm_k(k), None, None
    q, k = (t.unflatten(2, (heads, -1)) for t in (q, k))
    return qk_norm_rope(
        ops,
        norm_q,
        norm_k,
        q,
        k,
        cos_sin,
        diffusers_rope,
        across_heads=True,
        query_format=query_format,
    )


def _weights_ok(x, *weights) -> bool:
    return all(w is None or w.dtype in (x.dtype, torch.float32) for w in weights)


def _same_rope_tables(x, cos_sin) -> bool:
    cos, sin = cos_sin
    return (
        isinstance(cos, torch.Tensor)
        and isinstance(sin, torch.Tensor)
        and cos.dtype == sin.dtype
        and cos.dtype in (x.dtype, torch.float32)
    )


# ------------------------------------------------------------------------------------------------
# Feed-forward
# ------------------------------------------------------------------------------------------------
def feed_forward(ops, ff, x):
    """diffusers FeedForward (net = [activation with its projection, Dropout, Linear, ...]) with the
    GELU-tanh projection as one GEMM with a GELU epilogue, or GELU/GEGLU as our op. With FP8
    projections (x may then be QuantRows: feed_forward_input_format) the GELU and the down
    projection's input quantization are one pass."""
    net = list(ff.net)
    act = net[0]
    kind = type(act).__name__
    proj = getattr(act, "proj", None)
    ops = ops_for_step(ops, x, proj)
    h = None
    if isinstance(proj, Fp8Linear) and kind == "GELU" and _plain(act):
        h = _gelu_for(ops, proj(x), act.approximate, net[1:])
    elif _plain(act, proj) and _bf16_linear(proj) and _same_dtype(x, proj.weight, proj.bias):
        if kind == "GELU" and act.approximate == "tanh" and "linear_gelu" in ops:
            h = linear_gelu(x, proj.weight, proj.bias)
        elif kind == "GELU" and "gelu" in ops:
            h = gelu(F.linear(x, proj.weight, proj.bias), act.approximate)
        elif kind == "GEGLU" and "geglu" in ops:
            h = geglu(F.linear(x, proj.weight, proj.bias), "none")
    if h is None:
        h = act(x)
    for module in net[1:]:
        if not (isinstance(h, QuantRows) and isinstance(module, torch.nn.Dropout)):
            h = module(h)  # (rows pass inactive Dropouts only: _gelu_for)
    return h


def feed_forward_input_format(ff) -> str | None:
    """The format in which feed_forward takes its input as QuantRows (None: a tensor): its
    projection's, under a hook-free GELU."""
    act = ff.net[0]
    return input_format(act.proj) if type(act).__name__ == "GELU" and _plain(act) else None


def _gelu_for(ops, h, approximate: str, rest):
    """gelu(h) for the modules `rest` after it: quantized in the same pass (QuantRows) when the
    first of them past inactive Dropouts takes quantized rows. The quantized form runs where the
    bf16 step would run our kernel (linear_gelu for GELU-tanh, gelu otherwise)."""
    if ("linear_gelu" if approximate == "tanh" else "gelu") not in ops:
        return F.gelu(h, approximate=approximate)
    for module in rest:
        if isinstance(module, torch.nn.Dropout) and (module.p == 0 or not module.training):
            continue
        quant = input_format(module)
        if quant is not None:
            return quantize_rows(h, quant, "gelu", approximate)
        break
    return gelu(h, approximate)


def gated_attention_feed_forward(
    ops, norm, ff, x, attn_output, gate_msa, shift_mlp, scale_mlp, gate_mlp
):
    """One stream of an AdaLN-Zero double-stream block after its attention (FLUX, HunyuanVideo),
    with per-sample [B, D] modulation: h = x + gate_msa * attn and n = norm(h) * (1 + scale_mlp) +
    shift_mlp in one pass, then h + gate_mlp * ff(n)."""
    x, norm_x = add_norm_modulate(
        ops,
        norm,
        x,
        attn_output,
        scale_mlp[:, None],
        shift_mlp[:, None],
        gate_msa[:, None],
        quant=feed_forward_input_format(ff),
    )
    return residual(ops, x, feed_forward(ops, ff, norm_x), gate_mlp[:, None])


def feed_forward_fusable(ff) -> str | None:
    """None when feed_forward fuses ff's activation, else why not (for the report)."""
    kind = type(ff.net[0]).__name__
    return None if kind == "GELU" or kind == "GEGLU" else _no_kernel_for_activation(kind)


def linear_act(ops, proj, act, x):
    """act(proj(x)) for a Linear followed by a bare nn.GELU (FLUX's and HunyuanVideo's single-block
    MLP): GELU-tanh as one GEMM with a GELU epilogue, other GELUs as our gelu op."""
    ops = ops_for_step(ops, x, proj)
    # (a hook registered on act or proj must see its call: _plain)
    if linear_act_fusable(act) is None and _plain(act):
        if (
            "linear_gelu" in ops
            and act.approximate == "tanh"
            and _plain(proj)
            and _bf16_linear(proj)
            and _same_dtype(x, proj.weight, proj.bias)
        ):
            return linear_gelu(x, proj.weight, proj.bias)
        if "gelu" in ops:
            return gelu(proj(x), act.approximate)
    return act(proj(x))


def activation(ops, act, h):
    """act(h) for a bare activation module after its projection ran elsewhere (FLUX's single-block
    MLP after the fused q/k/v/MLP GEMM): GELU as our gelu op, which rounds as diffusers' GELU of
    the rounded projection output does."""
    ops = ops_for_step(ops, h)
    if "gelu" in ops and isinstance(act, torch.nn.GELU) and not has_hooks(act):
        return gelu(h, act.approximate)
    return act(h)


def linear_act_fusable(act) -> str | None:
    """None when linear_act fuses `act`, else why not (for the report)."""
    return None if isinstance(act, torch.nn.GELU) else _no_kernel_for_activation(type(act).__name__)


def _no_kernel_for_activation(kind: str) -> str:
    return f"activation {kind} has no fused kernel; it runs as in diffusers"


# ------------------------------------------------------------------------------------------------
# Norm without modulation after a residual, and the RoPE of one tensor (LTX-2: norm2 without the
# text-query modulation; audio-video cross-attention, whose queries and keys have their own tables)
# ------------------------------------------------------------------------------------------------
def add_norm(ops, norm, x, y, gate=None, quant: str | None = None):
    """h = x + y * gate (x + y without gate); n = norm(h), a diffusers RMSNorm or nn.LayerNorm
    without modulation. Returns (h, n) (quant: n as QuantRows where the op runs)."""
    ops = ops_for_step(ops, x, y, norm, gate)
    if _plain(norm) and _modulation_ok(x, norm, None, None, gate) and _same_dtype(x, y):
        if "add_rmsnorm_modulate" in ops and is_diffusers_rmsnorm(norm):
            op = _producer(add_rmsnorm_modulate, add_rmsnorm_modulate_quant, quant)
            return op(x, y, None, None, gate, norm.weight, norm.eps)
        if "add_layernorm_modulate" in ops and is_plain_layernorm(norm):
            op = _producer(add_layernorm_modulate, add_layernorm_modulate_quant, quant)
            return op(x, y, None, None, gate, norm.weight, norm.bias, norm.eps)
    h = residual(ops, x, y, gate)
    return h, diffusers_rmsnorm(ops, norm, h)


def rotate(ops, x, cos_sin, diffusers_rope, interleaved: bool = True):
    """RoPE of x with its own cos_sin = (cos, sin): the rope op, or diffusers_rope(x, cos_sin) (the
    model's own rotation) when the op is disabled or cannot take the tables."""
    ops = ops_for_step(ops, x, cos_sin)
    if "rope" in ops and _same_rope_tables(x, cos_sin):
        return rope(x, *cos_sin, interleaved)
    return diffusers_rope(x, cos_sin)
