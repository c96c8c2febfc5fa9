"""Fused-op micro-benchmark: every new ltx_kernels op against the eager diffusers code it replaces
and torch.compile of that same code, at LTX-Video and Wan-14B shapes (bf16).

    python benchmarks/benchmark_ops.py [--ops rope,gelu] [--shapes 2x8064x2048] [--out results]
    python benchmarks/benchmark_ops.py --backward   # forward + backward of each op (training)

Columns: "eager" (the diffusers expressions, written out below as plain PyTorch functions),
"torch.compile" (torch.compile(fullgraph=True, dynamic=False) of the same function) and
"ltx_kernels" (the fused op with the matching arguments). Per row: µs per call, TB/s counting the
bytes the op must read + write (every operand's unique bytes once), % of the copy bandwidth
measured in the same process, speedups, and the relative L2 error against the eager column.
Shapes are [B, S, D] of the hidden states; D == 5120 selects Wan-14B's fp32 forms
(`(... x.float() ...).type_as(x)`, per-head RoPE, FFN width 13824) where Wan has the pattern, any
other D the LTX-Video forms (bf16 throughout, FFN width 4 D). Also `linear_gelu` at LTX's FFN
projection ([5376, 2048] x [8192, 2048] + bias) in TFLOP/s. Prints a markdown table and PASS/MISS
lines; writes JSON and a PNG chart. Exits non-zero only on errors (an op that raises, or disagrees
with the eager column), never on missed targets.

--backward times forward + backward instead: every floating-point input requires grad (full
fine-tuning), each call returns the inputs' gradients for fixed random output gradients (eager
autograd of the diffusers code, torch.compile of it, and our op with its registered autograd).
Bytes then count what a fused forward + backward saving only its inputs must move: the inputs
(read twice), the outputs, the output gradients and the input gradients. linear_gelu is left out
there (its backward is cuBLAS GEMMs, as eager's).
"""

import argparse
import gc
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import bench_utils  # noqa: E402

from ltx_kernels import _op_names  # noqa: E402  (the op list; no build needed)

BF16 = torch.bfloat16
LTX_SHAPES = [(2, 2688, 2048), (2, 8064, 2048)]
WAN_SHAPE = (1, 32760, 5120)
DEFAULT_SHAPES = [*LTX_SHAPES, WAN_SHAPE]
TARGET_SHAPES = [(2, 8064, 2048), WAN_SHAPE]  # bandwidth target applies here
TARGET_FRACTION = 0.85  # of the measured copy bandwidth
TARGET_VS_COMPILE = 1.5  # ours at least this much faster than torch.compile
# --backward targets (issue 11): forward + backward >= 3x eager autograd and not slower than
# torch.compile of the same code; of the copy bandwidth: norm family 70%, elementwise ops 80%.
BACKWARD_VS_EAGER = 3.0
BACKWARD_VS_COMPILE = 1.0
BACKWARD_FRACTION = {"norm": 0.70, "elementwise": 0.80}
NORM_OPS = (
    "rmsnorm_modulate",
    "add_rmsnorm_modulate",
    "layernorm_modulate",
    "add_layernorm_modulate",
    "qk_rmsnorm_rope",
)
AGREE_REL_L2 = 1e-2  # ours vs eager; a few bf16 ulps of disagreement stay far below this

# Model constants, from the diffusers 0.42.1 sources cited at each eager function.
LTX_NORM_EPS = 1e-6  # LTXVideoTransformerBlock(eps=1e-6): norm1/norm2 RMSNorm
LTX_QK_EPS = 1e-5  # LTXAttention: norm_eps = 1e-5 for norm_q/norm_k (torch.nn.RMSNorm)
ADALN_EPS = 1e-6  # nn.LayerNorm(..., elementwise_affine=False, eps=1e-6): LTX norm_out, FLUX norm2
WAN_DIM = 5120  # Wan2.1/2.2 14B: dim 5120, 40 heads of 128, ffn_dim 13824, eps 1e-6
WAN_HEAD_DIM = 128
WAN_FFN_DIM = 13824
WAN_EPS = 1e-6
LINEAR_GELU_SHAPE = (2 * 2688, 2048, 4 * 2048)  # M (tokens), K (dim), N (LTX FFN inner dim)

# The ops benchmarked here: the op list (_op_names.OPS, so that a new op needs its case in
# build_case), less those benchmarked elsewhere.
BENCHMARKED_ELSEWHERE = {
    "rmsnorm": "benchmark_rmsnorm.py",
    "lora_linear": "benchmark_training.py (the LoRA step)",
}
OPS = tuple(op for op in _op_names.OPS if op not in BENCHMARKED_ELSEWHERE)
COLUMNS = ("eager", "torch.compile", "ltx_kernels")
OURS = "ltx_kernels"

ltx_kernels = None  # imported in main(), so that --help and the no-CUDA message need no build


# ------------------------------------------------------------------------------------------------
# Eager columns: the diffusers expressions each fused op replaces (diffusers 0.42.1, paths relative
# to diffusers/models/). The same functions are what torch.compile compiles.
# ------------------------------------------------------------------------------------------------
def diffusers_rmsnorm(x, eps):
    """normalization.py RMSNorm.forward, non-NPU branch, elementwise_affine=False:
    variance = x.to(float32).pow(2).mean(-1, keepdim=True); x = x * rsqrt(variance + eps);
    x.to(input_dtype)."""
    input_dtype = x.dtype
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return x.to(input_dtype)


def ltx_norm1_modulate(x, scale_msa, shift_msa):
    """transformers/transformer_ltx.py LTXVideoTransformerBlock.forward:
    norm_hidden_states = self.norm1(hidden_states)            # RMSNorm(dim, eps=1e-6), no weight
    norm_hidden_states = norm_hidden_states * (1 + scale_msa) + shift_msa
    scale_msa/shift_msa: [B, 1, D] unbind(dim=2) views of `scale_shift_table[None, None] + temb`."""
    return diffusers_rmsnorm(x, LTX_NORM_EPS) * (1 + scale_msa) + shift_msa


def ltx_attn2_residual_norm2_modulate(x, attn_output, scale_mlp, shift_mlp):
    """transformers/transformer_ltx.py LTXVideoTransformerBlock.forward, after attn2:
    hidden_states = hidden_states + attn_hidden_states
    norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp
    Returns (hidden_states, norm_hidden_states)."""
    hidden_states = x + attn_output
    return hidden_states, diffusers_rmsnorm(hidden_states, LTX_NORM_EPS) * (
        1 + scale_mlp
    ) + shift_mlp


def ltx_gated_residual(x, attn_output, gate_msa):
    """transformers/transformer_ltx.py LTXVideoTransformerBlock.forward:
    hidden_states = hidden_states + attn_hidden_states * gate_msa   (and `+ ff_output * gate_mlp`)."""
    return x + attn_output * gate_msa


def wan_gated_residual(x, attn_output, gate_msa):
    """transformers/transformer_wan.py WanTransformerBlock.forward (gate_msa fp32 [B, 1, D] chunk):
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)."""
    return (x.float() + attn_output * gate_msa).type_as(x)


def ltx_apply_rotary_emb(x, cos, sin):
    """transformers/transformer_ltx.py apply_rotary_emb(x, freqs=(cos, sin)): rotation over the
    full hidden dim, interleaved pairs, cos/sin fp32 [B, S, D]."""
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)  # [B, S, C // 2]
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def wan_apply_rotary_emb(hidden_states, freqs_cos, freqs_sin):
    """transformers/transformer_wan.py WanAttnProcessor.__call__, its inner apply_rotary_emb
    (kept verbatim in ltx_kernels.integration.wan): hidden_states [B, S, H, 128] bf16,
    freqs_cos/sin fp32 [1, S, 1, 128] (WanRotaryPosEmbed)."""
    from ltx_kernels.integration.wan import wan_rope

    return wan_rope(hidden_states, (freqs_cos, freqs_sin))


def ltx_qk_norm_rope(query, key, q_weight, k_weight, cos, sin):
    """transformers/transformer_ltx.py LTXVideoAttnProcessor.__call__:
    query = attn.norm_q(query); key = attn.norm_k(key)    # torch.nn.RMSNorm(D, eps=1e-5), weight
    query = apply_rotary_emb(query, image_rotary_emb); key = apply_rotary_emb(key, image_rotary_emb)
    (torch.nn.RMSNorm.forward is F.rms_norm(x, normalized_shape, weight, eps).)"""
    dim = query.shape[-1]
    query = F.rms_norm(query, (dim,), q_weight, LTX_QK_EPS)
    key = F.rms_norm(key, (dim,), k_weight, LTX_QK_EPS)
    return ltx_apply_rotary_emb(query, cos, sin), ltx_apply_rotary_emb(key, cos, sin)


def wan_qk_norm_rope(query, key, q_weight, k_weight, freqs_cos, freqs_sin):
    """transformers/transformer_wan.py WanAttnProcessor.__call__:
    query = attn.norm_q(query); key = attn.norm_k(key)    # torch.nn.RMSNorm(5120, eps=1e-6), weight
    query = query.unflatten(2, (attn.heads, -1)); key = key.unflatten(2, (attn.heads, -1))
    query = apply_rotary_emb(query, *rotary_emb); key = apply_rotary_emb(key, *rotary_emb)"""
    dim = query.shape[-1]
    query = F.rms_norm(query, (dim,), q_weight, WAN_EPS).unflatten(2, (-1, WAN_HEAD_DIM))
    key = F.rms_norm(key, (dim,), k_weight, WAN_EPS).unflatten(2, (-1, WAN_HEAD_DIM))
    return (
        wan_apply_rotary_emb(query, freqs_cos, freqs_sin),
        wan_apply_rotary_emb(key, freqs_cos, freqs_sin),
    )


def ffn_gelu_tanh(hidden_states):
    """activations.py GELU.forward after self.proj (FeedForward activation_fn="gelu-approximate",
    LTX-Video and Wan): F.gelu(gate, approximate="tanh")."""
    return F.gelu(hidden_states, approximate="tanh")


def geglu_after_proj(hidden_states):
    """activations.py GEGLU.forward after self.proj (non-NPU branch):
    hidden_states, gate = hidden_states.chunk(2, dim=-1); return hidden_states * self.gelu(gate)
    with GEGLU.gelu = F.gelu(gate) (approximate="none")."""
    hidden_states, gate = hidden_states.chunk(2, dim=-1)
    return hidden_states * F.gelu(gate)


def adaln_output_norm(x, scale, shift):
    """transformers/transformer_ltx.py LTXVideoTransformer3DModel.forward (output norm):
    hidden_states = self.norm_out(hidden_states)   # nn.LayerNorm(D, eps=1e-6, elementwise_affine=False)
    hidden_states = hidden_states * (1 + scale) + shift
    scale/shift: [B, 1, D] views [:, :, 1] / [:, :, 0] of `scale_shift_table[None, None] +
    embedded_timestep[:, :, None]`. FLUX's norm_out (normalization.py AdaLayerNormContinuous:
    self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]) is the same expression."""
    return F.layer_norm(x, (x.shape[-1],), None, None, ADALN_EPS) * (1 + scale) + shift


def wan_layernorm_modulate(x, scale_msa, shift_msa):
    """transformers/transformer_wan.py WanTransformerBlock.forward (norm1; norm3 and the model's
    norm_out are the same expression), scale/shift fp32 [B, 1, D] chunks of `table + temb.float()`:
    norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
    norm1 = FP32LayerNorm(dim, eps=1e-6, elementwise_affine=False) (normalization.py):
    F.layer_norm(inputs.float(), normalized_shape, None, None, eps).to(origin_dtype = float32)."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, WAN_EPS)
    return (normed * (1 + scale_msa) + shift_msa).type_as(x)


def flux_gated_residual_norm2_modulate(x, attn_output, gate_msa, scale_mlp, shift_mlp):
    """transformers/transformer_flux.py FluxTransformerBlock.forward (AdaLN-Zero), gate_msa/
    scale_mlp/shift_mlp: [B, D] chunk(6, dim=1) views of AdaLayerNormZero's projection:
    attn_output = gate_msa.unsqueeze(1) * attn_output
    hidden_states = hidden_states + attn_output
    norm_hidden_states = self.norm2(hidden_states)   # nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
    norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    Returns (hidden_states, norm_hidden_states)."""
    hidden_states = x + gate_msa.unsqueeze(1) * attn_output
    norm_hidden_states = F.layer_norm(hidden_states, (x.shape[-1],), None, None, ADALN_EPS)
    return hidden_states, norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]


def wan_attn2_residual_norm3_modulate(x, attn_output, c_scale_msa, c_shift_msa):
    """transformers/transformer_wan.py WanTransformerBlock.forward, after the cross-attention:
    hidden_states = hidden_states + attn_output
    norm_hidden_states = (self.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)
    Returns (hidden_states, norm_hidden_states)."""
    hidden_states = x + attn_output
    normed = F.layer_norm(hidden_states.float(), (x.shape[-1],), None, None, WAN_EPS)
    return hidden_states, (normed * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)


def linear_gelu_eager(x, weight, bias):
    """activations.py GELU.forward with approximate="tanh" (FeedForward's first projection):
    hidden_states = self.proj(hidden_states); F.gelu(hidden_states, approximate="tanh")."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


# ------------------------------------------------------------------------------------------------
# Inputs: random activations and the modulation / RoPE tensors laid out as the models make them.
# ------------------------------------------------------------------------------------------------
def randn(*shape, dtype=BF16, std: float = 1.0):
    return (std * torch.randn(shape, device="cuda")).to(dtype)


def ltx_block_modulation(batch: int, dim: int):
    """LTX block modulation: [B, 1, 6, D] bf16 `scale_shift_table[None, None] + temb.reshape(B, 1,
    6, -1)` unbound along dim 2 into (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp,
    gate_mlp), each a [B, 1, D] view (row stride 6 D)."""
    table = randn(6, dim, std=dim**-0.5)
    temb = randn(batch, 1, 6 * dim, std=0.3)
    return (table[None, None] + temb.reshape(batch, 1, 6, -1)).unbind(dim=2)


def ltx_output_modulation(batch: int, dim: int):
    """LTX output norm: [B, 1, 2, D] bf16 `scale_shift_table[None, None] + embedded_timestep[:, :,
    None]`; returns (shift, scale) = [:, :, 0], [:, :, 1], [B, 1, D] views."""
    table = randn(2, dim, std=dim**-0.5)
    embedded_timestep = randn(batch, 1, dim, std=0.3)
    values = table[None, None] + embedded_timestep[:, :, None]
    return values[:, :, 0], values[:, :, 1]


def flux_block_modulation(batch: int, dim: int):
    """FLUX AdaLayerNormZero: emb [B, 6 D] bf16 chunk(6, dim=1) into (shift_msa, scale_msa, gate_msa,
    shift_mlp, scale_mlp, gate_mlp), each a [B, D] view (row stride 6 D)."""
    return randn(batch, 6 * dim, std=0.3).chunk(6, dim=1)


def wan_block_modulation(batch: int, dim: int):
    """Wan block modulation: fp32 `scale_shift_table [1, 6, D] + temb.float() [B, 6, D]` chunk(6,
    dim=1) into (shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa), each a
    [B, 1, D] fp32 view (row stride 6 D)."""
    table = randn(1, 6, dim, dtype=torch.float32, std=dim**-0.5)
    temb = randn(batch, 6, dim, std=0.3)
    return (table + temb.float()).chunk(6, dim=1)


def rope_tables(angle_shape):
    """fp32 cos/sin of random angles, each value repeated for the two members of a rotated pair
    (repeat_interleave(2, dim=-1)), as LTXVideoRotaryPosEmbed and get_1d_rotary_pos_embed(...,
    repeat_interleave_real=True) build them. angle_shape: the table's shape with the last dim halved."""
    angles = torch.rand(angle_shape, device="cuda") * (2 * math.pi)
    return angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)


# ------------------------------------------------------------------------------------------------
# Cases: one op at one shape.
# ------------------------------------------------------------------------------------------------
@dataclass
class Case:
    """One benchmark row: `make()` returns one input set (the exact arguments), `eager` the
    diffusers code, `ours` the ltx_kernels call; both take the same arguments."""

    op: str
    form: str
    make: Callable[[], tuple]
    eager: Callable
    ours: Callable
    extra_bytes: int = 0  # traffic beyond the arguments and the result (--backward: forward's)
    constants: tuple = ()  # indices of arguments no gradient flows to (RoPE tables)
    backward_args: int = 0  # > 0: time forward + backward; make() gives this many op arguments


def with_backward(case: Case) -> Case:
    """The forward + backward of `case`: make() gives the op's arguments, every floating-point
    tensor but the constants a leaf requiring grad, followed by one random gradient per output;
    bench_memory_op times forward_backward(column) on them."""
    probe = case.make()
    with torch.no_grad():
        outputs = as_tuple(case.eager(*probe))
    forward_bytes = tensor_bytes([a for a in probe if isinstance(a, torch.Tensor)]) + tensor_bytes(
        outputs
    )
    n_args = len(probe)
    del probe

    def make():
        args = tuple(
            a.detach().requires_grad_()
            if isinstance(a, torch.Tensor) and a.is_floating_point() and i not in case.constants
            else a
            for i, a in enumerate(case.make())
        )
        return (*args, *(torch.randn_like(o) for o in outputs))

    return Case(
        case.op,
        case.form + " fwd+bwd",
        make,
        case.eager,
        case.ours,
        extra_bytes=forward_bytes,
        constants=case.constants,
        backward_args=n_args,
    )


def forward_backward(fn, n_args: int):
    """fn's forward + backward: run(*args, *output_grads) returns the gradients of args that
    require grad (torch.autograd.grad), as a training step's backward computes them."""

    def run(*args):
        inputs, grads = args[:n_args], args[n_args:]
        wanted = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        return torch.autograd.grad(as_tuple(fn(*inputs)), wanted, grads)

    return run


def is_wan(shape) -> bool:
    return shape[-1] == WAN_DIM


def build_case(op: str, shape) -> Case:
    """The case for `op` at hidden-state shape [B, S, D] (Wan forms when D == 5120)."""
    batch, seq, dim = shape
    wan = is_wan(shape)
    x = lambda: randn(batch, seq, dim)  # noqa: E731
    if op == "rmsnorm_modulate":  # Wan has no RMSNorm modulation: LTX form at every shape

        def make():
            shift_msa, scale_msa = ltx_block_modulation(batch, dim)[:2]
            return x(), scale_msa, shift_msa

        return Case(
            op,
            "LTX norm1",
            make,
            ltx_norm1_modulate,
            lambda x, scale, shift: ltx_kernels.rmsnorm_modulate(
                x, scale, shift, None, LTX_NORM_EPS
            ),
        )
    if op == "add_rmsnorm_modulate":  # LTX form at every shape

        def make():
            modulation = ltx_block_modulation(batch, dim)
            return x(), x(), modulation[4], modulation[3]  # scale_mlp, shift_mlp

        return Case(
            op,
            "LTX attn2+norm2",
            make,
            ltx_attn2_residual_norm2_modulate,
            lambda x, y, scale, shift: ltx_kernels.add_rmsnorm_modulate(
                x, y, scale, shift, None, None, LTX_NORM_EPS
            ),
        )
    if op == "layernorm_modulate":
        if wan:

            def make():
                shift_msa, scale_msa = wan_block_modulation(batch, dim)[:2]
                return x(), scale_msa, shift_msa

            return Case(
                op,
                "Wan norm1 fp32",
                make,
                wan_layernorm_modulate,
                lambda x, scale, shift: ltx_kernels.layernorm_modulate(
                    x, scale, shift, None, None, WAN_EPS, upcast=True
                ),
            )

        def make():
            shift, scale = ltx_output_modulation(batch, dim)
            return x(), scale, shift

        return Case(
            op,
            "LTX/FLUX norm_out",
            make,
            adaln_output_norm,
            lambda x, scale, shift: ltx_kernels.layernorm_modulate(
                x, scale, shift, None, None, ADALN_EPS
            ),
        )
    if op == "add_layernorm_modulate":
        if wan:

            def make():
                modulation = wan_block_modulation(batch, dim)
                return x(), x(), modulation[4], modulation[3]  # c_scale_msa, c_shift_msa

            return Case(
                op,
                "Wan attn2+norm3 fp32",
                make,
                wan_attn2_residual_norm3_modulate,
                lambda x, y, scale, shift: ltx_kernels.add_layernorm_modulate(
                    x, y, scale, shift, None, None, None, WAN_EPS, upcast=True
                ),
            )

        def make():
            modulation = flux_block_modulation(batch, dim)
            return (
                x(),
                x(),
                modulation[2],
                modulation[4],
                modulation[3],
            )  # gate_msa, scale_mlp, shift_mlp

        return Case(
            op,
            "FLUX attn+norm2",
            make,
            flux_gated_residual_norm2_modulate,
            lambda x, y, gate, scale, shift: ltx_kernels.add_layernorm_modulate(
                x, y, scale[:, None], shift[:, None], gate[:, None], None, None, ADALN_EPS
            ),
        )
    if op == "gated_residual":
        if wan:

            def make():
                return x(), x(), wan_block_modulation(batch, dim)[2]  # gate_msa, fp32

            return Case(
                op,
                "Wan fp32 gate",
                make,
                wan_gated_residual,
                lambda x, y, gate: ltx_kernels.gated_residual(x, y, gate, upcast=True),
            )

        def make():
            return x(), x(), ltx_block_modulation(batch, dim)[2]  # gate_msa

        return Case(
            op,
            "LTX gate_msa",
            make,
            ltx_gated_residual,
            lambda x, y, gate: ltx_kernels.gated_residual(x, y, gate),
        )
    if op == "rope":
        if wan:

            def make():
                cos, sin = rope_tables((1, seq, 1, WAN_HEAD_DIM // 2))
                return randn(batch, seq, dim // WAN_HEAD_DIM, WAN_HEAD_DIM), cos, sin

            return Case(
                op,
                "Wan per head",
                make,
                wan_apply_rotary_emb,
                lambda x, cos, sin: ltx_kernels.rope(x, cos, sin, True),
                constants=(1, 2),
            )

        def make():
            cos, sin = rope_tables((batch, seq, dim // 2))
            return x(), cos, sin

        return Case(
            op,
            "LTX full D",
            make,
            ltx_apply_rotary_emb,
            lambda x, cos, sin: ltx_kernels.rope(x, cos, sin, True),
            constants=(1, 2),
        )
    if op == "qk_rmsnorm_rope":
        weight = lambda: (1 + randn(dim, dtype=torch.float32, std=0.1)).to(BF16)  # noqa: E731
        if wan:

            def make():
                cos, sin = rope_tables((1, seq, 1, WAN_HEAD_DIM // 2))
                return x(), x(), weight(), weight(), cos, sin

            def ours(q, k, q_weight, k_weight, cos, sin):
                return ltx_kernels.qk_rmsnorm_rope(
                    q.unflatten(2, (-1, WAN_HEAD_DIM)),
                    k.unflatten(2, (-1, WAN_HEAD_DIM)),
                    q_weight,
                    k_weight,
                    cos,
                    sin,
                    WAN_EPS,
                    True,
                    True,
                )

            return Case(
                op,
                "Wan norm over D + per-head rope",
                make,
                wan_qk_norm_rope,
                ours,
                constants=(4, 5),
            )

        def make():
            cos, sin = rope_tables((batch, seq, dim // 2))
            return x(), x(), weight(), weight(), cos, sin

        return Case(
            op,
            "LTX norm_q/k + rope",
            make,
            ltx_qk_norm_rope,
            lambda q, k, q_weight, k_weight, cos, sin: ltx_kernels.qk_rmsnorm_rope(
                q, k, q_weight, k_weight, cos, sin, LTX_QK_EPS, True, True
            ),
            constants=(4, 5),
        )
    ffn_dim = WAN_FFN_DIM if wan else 4 * dim
    if op == "gelu":
        return Case(
            op,
            f"FFN GELU-tanh [{batch},{seq},{ffn_dim}]",
            lambda: (randn(batch, seq, ffn_dim),),
            ffn_gelu_tanh,
            lambda h: ltx_kernels.gelu(h, "tanh"),
        )
    if op == "geglu":
        return Case(
            op,
            f"GEGLU [{batch},{seq},2x{ffn_dim}]",
            lambda: (randn(batch, seq, 2 * ffn_dim),),
            geglu_after_proj,
            lambda h: ltx_kernels.geglu(h, "none"),
        )
    raise ValueError(f"unknown op {op!r}")


# ------------------------------------------------------------------------------------------------
# Measurement helpers.
# ------------------------------------------------------------------------------------------------
def as_tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def tensor_bytes(tensors) -> int:
    """Bytes of each tensor's own elements (a [B, 1, D] view of a bigger table counts B*D)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def rel_l2(got, expected, chunk: int = 1 << 26) -> float:
    """Largest relative L2 error over the outputs (tuple or tensor), in fp32 chunks."""
    worst = 0.0
    got, expected = as_tuple(got), as_tuple(expected)
    if len(got) != len(expected):
        raise ValueError(f"{len(got)} outputs, eager has {len(expected)}")
    for a, b in zip(got, expected):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"output {tuple(a.shape)} {a.dtype}, eager {tuple(b.shape)} {b.dtype}")
        a, b = a.reshape(-1), b.reshape(-1)
        diff_sq = ref_sq = 0.0
        for start in range(0, a.numel(), chunk):
            ac, bc = a[start : start + chunk].float(), b[start : start + chunk].float()
            diff_sq += (ac - bc).pow(2).sum().item()
            ref_sq += bc.pow(2).sum().item()
        worst = max(worst, math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else math.sqrt(diff_sq))
    return worst


def free_memory() -> None:
    """Drop compiled graphs and cached blocks between cases (the Wan shape needs several GB)."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def shape_label(shape) -> str:
    return "x".join(map(str, shape))


def parse_shape(text: str):
    try:
        shape = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) <= 0 or shape[-1] % 2:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: expected BxSxD with even D, e.g. 2x8064x2048"
        )
    return shape


def run_columns(columns: dict, sets, replays: int, expected, row_base: dict, errors: list):
    """Times every column on the input sets; returns {column: row dict}. A failing column is
    recorded in `errors` and left out."""
    rows = {}
    for name, fn in columns.items():
        try:
            start = time.perf_counter()
            out = fn(*sets[0])
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - start
            err = rel_l2(out, expected)
            del out
            us = bench_utils.graph_time_us(fn, sets, replays=replays)
        except Exception as error:  # noqa: BLE001  (report it and go on with the other columns)
            message = f"{row_base['op']} {row_base['shape_label']} {name}: {type(error).__name__}: {error}"
            print(f"  ERROR {message}")
            traceback.print_exc(limit=3)
            errors.append(message)
            continue
        rows[name] = {
            **row_base,
            "column": name,
            "us": us,
            "rel_l2_vs_eager": err,
            "first_call_s": first_call_s,
        }
    return rows


def fmt_cell(row) -> str:
    if row is None:
        return "error"
    if "tbs" in row:
        return f"{row['us']:.1f} µs / {row['tbs']:.2f} TB/s"
    return f"{row['us']:.1f} µs / {row['tflops']:.0f} TFLOP/s"


# ------------------------------------------------------------------------------------------------
def bench_memory_op(case: Case, shape, replays: int, copy_tbs: float, errors: list) -> dict:
    """Rows of one memory-bound op at one shape: {column: row}."""
    label = shape_label(shape)
    probe = case.make()
    set_bytes = tensor_bytes(probe)
    del probe
    sets = bench_utils.input_sets(case.make, set_bytes)
    columns = {
        "eager": case.eager,
        "torch.compile": torch.compile(case.eager, fullgraph=True, dynamic=False),
        OURS: case.ours,
    }
    if case.backward_args:
        columns = {name: forward_backward(fn, case.backward_args) for name, fn in columns.items()}
    expected = columns["eager"](*sets[0])
    nbytes = set_bytes + tensor_bytes(as_tuple(expected)) + case.extra_bytes
    base = {
        "op": case.op,
        "form": case.form,
        "shape": list(shape),
        "shape_label": label,
        "bytes": nbytes,
        "sets": len(sets),
    }
    rows = run_columns(columns, sets, replays, expected, base, errors)
    for row in rows.values():
        row["tbs"] = nbytes / (row["us"] * 1e-6) / 1e12
        row["pct_copy"] = 100 * row["tbs"] / copy_tbs
    del sets, expected, columns
    free_memory()
    if OURS in rows:
        ours = rows[OURS]
        for name in ("eager", "torch.compile"):
            if name in rows:
                ours[f"speedup_vs_{name}"] = rows[name]["us"] / ours["us"]
        if ours["rel_l2_vs_eager"] > AGREE_REL_L2:
            errors.append(
                f"{case.op} {label}: ltx_kernels disagrees with eager "
                f"(rel. L2 {ours['rel_l2_vs_eager']:.2e} > {AGREE_REL_L2:.0e})"
            )
    cells = []
    for name in COLUMNS:
        row = rows.get(name)
        cells.append(
            f"{name} "
            + (
                "error"
                if row is None
                else f"{row['us']:8.1f} µs {row['tbs']:5.2f} TB/s ({row['pct_copy']:3.0f}%) "
                f"err {row['rel_l2_vs_eager']:.1e}"
            )
        )
    compile_s = rows["torch.compile"]["first_call_s"] if "torch.compile" in rows else float("nan")
    print(
        f"{case.op + ' [' + case.form + ']':<48} {label:>13}: "
        + " | ".join(cells)
        + f" | compile {compile_s:.1f} s",
        flush=True,
    )
    return rows


def bench_linear_gelu(replays: int, errors: list) -> dict:
    """linear_gelu at LTX's FFN projection: x [M, K] bf16, weight [N, K], bias [N]."""
    m, k, n = LINEAR_GELU_SHAPE
    make = lambda: (randn(m, k), randn(n, k, std=k**-0.5), randn(n, std=0.1))  # noqa: E731
    probe = make()
    sets = bench_utils.input_sets(make, tensor_bytes(probe))
    del probe
    expected = linear_gelu_eager(*sets[0])
    columns = {
        "Linear+GELU eager": linear_gelu_eager,
        "torch.compile": torch.compile(linear_gelu_eager, fullgraph=True, dynamic=False),
        OURS: lambda x, w, b: ltx_kernels.linear_gelu(x, w, b),
    }
    label = f"{m}x{k} @ {n}x{k}"
    base = {
        "op": "linear_gelu",
        "form": "LTX FFN proj + GELU-tanh",
        "shape": [m, k, n],
        "shape_label": label,
        "flops": 2 * m * n * k,
        "sets": len(sets),
    }
    rows = run_columns(columns, sets, replays, expected, base, errors)
    for row in rows.values():
        row["tflops"] = row["flops"] / (row["us"] * 1e-6) / 1e12
    names = list(columns)
    del sets, expected, columns
    free_memory()
    if OURS in rows:
        for name in ("Linear+GELU eager", "torch.compile"):
            if name in rows:
                rows[OURS][f"speedup_vs_{name}"] = rows[name]["us"] / rows[OURS]["us"]
        # cuBLASLt's epilogue and a separate GELU round differently only at the last bit
        if rows[OURS]["rel_l2_vs_eager"] > AGREE_REL_L2:
            errors.append(
                f"linear_gelu: ltx_kernels disagrees with eager "
                f"(rel. L2 {rows[OURS]['rel_l2_vs_eager']:.2e} > {AGREE_REL_L2:.0e})"
            )
    print(
        f"{'linear_gelu [' + base['form'] + ']':<48} {label:>13}: "
        + " | ".join(
            f"{name} "
            + (
                "error"
                if name not in rows
                else f"{rows[name]['us']:8.1f} µs {rows[name]['tflops']:4.0f} TFLOP/s "
                f"err {rows[name]['rel_l2_vs_eager']:.1e}"
            )
            for name in names
        ),
        flush=True,
    )
    return rows


def verdicts_for(op: str, results: dict, shapes, backward: bool = False) -> list:
    """(text, ok) per target for one memory-bound op; results[(op, shape)] = {column: row}.
    backward: the forward + backward targets (all shapes)."""
    lines = []
    entries = [(s, results.get((op, s), {})) for s in shapes]
    target_entries = entries if backward else [(s, e) for s, e in entries if s in TARGET_SHAPES]
    fraction = (
        BACKWARD_FRACTION["norm" if op in NORM_OPS else "elementwise"]
        if backward
        else TARGET_FRACTION
    )
    if target_entries:
        fracs = [(s, e[OURS]["pct_copy"] if OURS in e else None) for s, e in target_entries]
        ok = all(f is not None and f >= 100 * fraction for _, f in fracs)
        lines.append(
            (
                f"{op}: >= {fraction:.0%} of copy bandwidth: "
                + ", ".join(
                    f"{shape_label(s)} {'error' if f is None else f'{f:.0f}%'}" for s, f in fracs
                ),
                ok,
            )
        )
    speed_targets = (
        (("eager", BACKWARD_VS_EAGER), ("torch.compile", BACKWARD_VS_COMPILE))
        if backward
        else (("torch.compile", TARGET_VS_COMPILE),)
    )
    for column, target in speed_targets:
        speedups = [
            (s, e[OURS].get(f"speedup_vs_{column}") if OURS in e else None) for s, e in entries
        ]
        ok = all(v is not None and v >= target for _, v in speedups)
        lines.append(
            (
                f"{op}: >= {target}x faster than {column}: "
                + ", ".join(
                    f"{shape_label(s)} {'n/a' if v is None else f'{v:.2f}x'}" for s, v in speedups
                ),
                ok,
            )
        )
    errs = [(s, e[OURS]["rel_l2_vs_eager"] if OURS in e else None) for s, e in entries]
    ok = all(v is not None and v <= AGREE_REL_L2 for _, v in errs)
    lines.append(
        (
            f"{op}: agrees with eager (rel. L2 <= {AGREE_REL_L2:.0e}): "
            + ", ".join(f"{shape_label(s)} {'n/a' if v is None else f'{v:.1e}'}" for s, v in errs),
            ok,
        )
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument(
        "--ops", default=",".join(OPS), help="comma-separated ops (default: all): " + ", ".join(OPS)
    )
    parser.add_argument(
        "--shapes",
        default=",".join(map(shape_label, DEFAULT_SHAPES)),
        help="comma-separated BxSxD hidden-state shapes (default: %(default)s); "
        f"D == {WAN_DIM} uses the Wan forms. linear_gelu always runs at "
        f"{LINEAR_GELU_SHAPE[0]}x{LINEAR_GELU_SHAPE[1]} @ "
        f"{LINEAR_GELU_SHAPE[2]}x{LINEAR_GELU_SHAPE[1]}",
    )
    parser.add_argument("--replays", type=int, default=30, help="timed graph replays (median)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="results directory")
    parser.add_argument(
        "--backward",
        action="store_true",
        help="time forward + backward (every input requires grad)",
    )
    args = parser.parse_args()
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        parser.error(
            f"unknown op(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(OPS)}"
        )
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if not shapes:
        parser.error("no shapes given")
    if not torch.cuda.is_available():
        print("benchmark_ops: needs a CUDA device")
        return 2
    global ltx_kernels
    try:
        import ltx_kernels as module
    except Exception as error:  # noqa: BLE001  (ImportError, or a stale build missing ops)
        print(
            f"benchmark_ops: cannot import ltx_kernels ({type(error).__name__}: {error}); build it with "
            "`pip install -e . --no-build-isolation`"
        )
        return 2
    if module.load_error is not None:
        print(f"benchmark_ops: the ltx_kernels extension failed to load: {module.load_error}")
        return 2
    ltx_kernels = module

    started = time.perf_counter()
    env = bench_utils.environment()
    copy = bench_utils.copy_bandwidth()
    copy_tbs = copy["best"]
    print(
        f"# Fused ops, bf16 | {env['device']} | torch {env['torch']} | copy bandwidth {copy_tbs:.2f} "
        "TB/s (best of " + ", ".join(f"{k} {v:.2f}" for k, v in copy.items() if k != "best") + ")"
    )
    print(
        f"# TB/s = bytes the op reads + writes / time; err = rel. L2 vs eager; targets: >= "
        f"{TARGET_FRACTION:.0%} of copy at {', '.join(map(shape_label, TARGET_SHAPES))}, >= "
        f"{TARGET_VS_COMPILE}x vs torch.compile",
        flush=True,
    )

    errors, results, linear_rows = [], {}, {}
    memory_ops = [op for op in ops if op != "linear_gelu"]
    if args.backward:
        print(
            "# forward + backward: every input requires grad; linear_gelu left out (cuBLAS "
            "GEMMs, as eager)"
        )
        ops = memory_ops
    for op in memory_ops:
        for shape in shapes:
            try:
                case = build_case(op, shape)
                if args.backward:
                    case = with_backward(case)
                results[(op, shape)] = bench_memory_op(case, shape, args.replays, copy_tbs, errors)
            except Exception as error:  # noqa: BLE001  (inputs or eager failed: report, go on)
                message = f"{op} {shape_label(shape)}: {type(error).__name__}: {error}"
                print(f"  ERROR {message}")
                traceback.print_exc(limit=3)
                errors.append(message)
                results[(op, shape)] = {}
                free_memory()
    if "linear_gelu" in ops:
        try:
            linear_rows = bench_linear_gelu(args.replays, errors)
        except Exception as error:  # noqa: BLE001
            errors.append(f"linear_gelu: {type(error).__name__}: {error}")
            print(f"  ERROR {errors[-1]}")
            free_memory()

    # Summary table.
    print()
    print("| op | shape | eager | compile | ours | %copy | vs eager | vs compile |")
    print("|---|---|---|---|---|---|---|---|")
    for (op, shape), rows in results.items():
        ours = rows.get(OURS)
        pct = f"{ours['pct_copy']:.0f}%" if ours else "-"
        vs_eager = (
            f"{ours['speedup_vs_eager']:.2f}x" if ours and "speedup_vs_eager" in ours else "-"
        )
        vs_compile = (
            f"{ours['speedup_vs_torch.compile']:.2f}x"
            if ours and "speedup_vs_torch.compile" in ours
            else "-"
        )
        form = next(iter(rows.values()))["form"] if rows else ""
        print(
            f"| {op} ({form}) | {shape_label(shape)} | {fmt_cell(rows.get('eager'))} | "
            f"{fmt_cell(rows.get('torch.compile'))} | {fmt_cell(ours)} | {pct} | {vs_eager} | {vs_compile} |"
        )
    if linear_rows or "linear_gelu" in ops:
        ours = linear_rows.get(OURS)
        m, k, n = LINEAR_GELU_SHAPE
        vs_eager = (
            f"{ours['speedup_vs_Linear+GELU eager']:.2f}x"
            if ours and "speedup_vs_Linear+GELU eager" in ours
            else "-"
        )
        vs_compile = (
            f"{ours['speedup_vs_torch.compile']:.2f}x"
            if ours and "speedup_vs_torch.compile" in ours
            else "-"
        )
        print(
            f"| linear_gelu (Linear+GELU) | {m}x{k} @ {n}x{k} | {fmt_cell(linear_rows.get('Linear+GELU eager'))} | "
            f"{fmt_cell(linear_rows.get('torch.compile'))} | {fmt_cell(ours)} | - | {vs_eager} | {vs_compile} |"
        )

    # Verdicts.
    verdicts = []
    for op in memory_ops:
        verdicts += verdicts_for(op, results, shapes, args.backward)
    if "linear_gelu" in ops:
        ours, eager = linear_rows.get(OURS), linear_rows.get("Linear+GELU eager")
        ok = bool(ours and eager and ours["us"] < eager["us"])
        detail = (
            f"{ours['us']:.1f} µs vs {eager['us']:.1f} µs ({eager['us'] / ours['us']:.2f}x)"
            if ours and eager
            else "error"
        )
        verdicts.append((f"linear_gelu: faster than eager Linear+GELU: {detail}", ok))
    print()
    for what, ok in verdicts:
        print(f"  [{'PASS' if ok else 'MISS'}] {what}")
    for message in errors:
        print(f"  [ERROR] {message}")

    # JSON and chart.
    rows = [row for entry in results.values() for row in entry.values()] + list(
        linear_rows.values()
    )
    stem = "benchmark_ops_backward" if args.backward else "benchmark_ops"
    bench_utils.write_json(
        args.out / f"{stem}.json",
        {
            "environment": env,
            "copy_tbs": copy,
            "dtype": "bf16",
            "ops": ops,
            "backward": args.backward,
            "shapes": [list(s) for s in shapes],
            "targets": {
                "fraction_of_copy": TARGET_FRACTION,
                "target_shapes": [list(s) for s in TARGET_SHAPES],
                "speedup_vs_compile": TARGET_VS_COMPILE,
                "agree_rel_l2": AGREE_REL_L2,
            },
            "rows": rows,
            "verdicts": verdicts,
            "errors": errors,
            "wall_s": time.perf_counter() - started,
        },
    )
    groups = [f"{op}\n{shape_label(shape)}" for (op, shape), entry in results.items() if entry]
    tbs = {
        f"{op}\n{shape_label(shape)}": {name: row["tbs"] for name, row in entry.items()}
        for (op, shape), entry in results.items()
        if entry
    }
    if groups:
        bench_utils.bar_chart(
            args.out / f"{stem}.png",
            f"Fused ops, bf16 — {env['device']}, torch "
            f"{env['torch']} (TB/s = bytes read + written / time)",
            groups,
            list(COLUMNS),
            tbs,
            copy_tbs,
        )
    print(
        f"wrote {args.out / stem}.json"
        + (" and .png" if groups else "")
        + f" ({time.perf_counter() - started:.0f} s)"
    )
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
