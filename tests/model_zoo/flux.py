"""FLUX.1: the tiny transformer (as diffusers' own model tests build it) with its inputs and the
ltx_kernels ops one injected forward runs."""

import torch
from diffusers import FluxTransformer2DModel

import step_inputs
from inject_helpers import randomize_norms
from ltx_kernels.integration import FUSIONS

TINY = dict(
    patch_size=1,
    in_channels=4,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=[4, 4, 8],
)
HEIGHT, WIDTH, TEXT = 4, 4, 5


def expected_ops(ops, double: int, single: int, fp8: bool = False) -> dict:
    """ltx_kernels op calls per forward of a FLUX model with `ops` enabled: each step runs its op,
    or the op of its fallback (the unfused step's pieces); fp8: injected with fp8=True (the single
    block's q/k/v + MLP GEMM, fused_qkv_mlp, forms only then)."""
    ops = set(ops)
    counts = dict.fromkeys(FUSIONS, 0)

    def norm_modulate(n):
        counts["layernorm_modulate"] += n * ("layernorm_modulate" in ops)

    def residual(n):
        counts["gated_residual"] += n * ("gated_residual" in ops)

    norm_modulate(2 * double + single + 1)  # norm1, norm1_context, single norm, norm_out
    if "add_layernorm_modulate" in ops:  # x + gate * attn, norm2 + modulation, both streams
        counts["add_layernorm_modulate"] += 2 * double
    else:
        residual(2 * double)
        norm_modulate(2 * double)
    residual(2 * double + single)  # FF residuals, single-block output
    attentions = 2 * double + single  # q/k norm + RoPE: one per stream
    if "qk_rmsnorm_rope" in ops:
        counts["qk_rmsnorm_rope"] += attentions
    elif "rope" in ops:
        counts["rope"] += 2 * attentions
    # FF up-projections + GELU-tanh, and the single blocks' MLP: after the fused q/k/v/MLP GEMM
    # (fused_qkv_mlp, FP8) its GELU is the gelu op, else as the FFs'
    fused_mlps = single * ("fused_qkv_mlp" in ops and fp8)
    mlps = 2 * double + single - fused_mlps
    if "linear_gelu" in ops:
        counts["linear_gelu"] += mlps
    elif "gelu" in ops:
        counts["gelu"] += mlps
    counts["gelu"] += fused_mlps * ("gelu" in ops)
    return {op: n for op, n in counts.items() if n}


def tiny_model(dtype, **config):
    return randomize_norms(FluxTransformer2DModel(**{**TINY, **config}).to(dtype).eval())


image_ids = step_inputs.image_ids


def tiny_block(kind: str, dtype):
    """(block, call): a bare FluxTransformerBlock ("double") or FluxSingleTransformerBlock
    ("single") of the tiny model's sizes, norms randomized, in eval mode, and call(block), its
    output (text and image rows concatenated) on random inputs with FLUX RoPE tables."""
    from diffusers.models.transformers.transformer_flux import (
        FluxPosEmbed,
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )

    dim, heads, head_dim = 32, TINY["num_attention_heads"], TINY["attention_head_dim"]
    cls = FluxTransformerBlock if kind == "double" else FluxSingleTransformerBlock
    block = randomize_norms(cls(dim, heads, head_dim).to(dtype)).eval()
    ids = torch.cat([torch.zeros(TEXT, 3), image_ids(HEIGHT, WIDTH)])
    rope = FluxPosEmbed(theta=10000, axes_dim=TINY["axes_dims_rope"])(ids)
    hidden = torch.randn(2, HEIGHT * WIDTH, dim, dtype=dtype)
    text = torch.randn(2, TEXT, dim, dtype=dtype)
    temb = torch.randn(2, dim, dtype=dtype)
    return block, lambda b: torch.cat(b(hidden, text, temb, rope), dim=1)


def tiny_inputs(dtype, batch=2):
    """step_inputs.flux with a random timestep and text positions that differ, so the text rows of
    the RoPE tables matter (FLUX uses zeros)."""
    inputs = step_inputs.flux(
        TINY,
        lambda *shape: torch.randn(*shape, dtype=dtype),
        batch=batch,
        height=HEIGHT,
        width=WIDTH,
        text=TEXT,
        timestep=lambda: torch.rand(batch, dtype=dtype),
        ids_dtype=torch.float32,
        device="cpu",
    )
    inputs["txt_ids"] = torch.randint(0, 8, (TEXT, 3)).float()
    return inputs
