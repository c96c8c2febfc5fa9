"""LTX-Video: the tiny transformer (as diffusers' own model tests build it) with its inputs and the
ltx_kernels ops one injected forward runs; the inputs of the full-size transformer."""

import torch
from diffusers import LTXVideoTransformer3DModel

from inject_helpers import block_op_counts, randomize_norms

TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    num_layers=2,
    caption_channels=16,
)
FRAMES, HEIGHT, WIDTH, TEXT = 2, 4, 4, 6
# Per block: norm1, q/k of attn1 and attn2, two gated residuals, attn2 residual + norm2, FF.
OPS_PER_BLOCK = {
    "rmsnorm_modulate": 1,
    "qk_rmsnorm_rope": 2,
    "gated_residual": 2,
    "add_rmsnorm_modulate": 1,
    "linear_gelu": 1,
}
# The counts of a block that change when one op is disabled.
FALLBACKS = {
    # x + attn2 (gated_residual without a gate), then norm2 + modulation
    "add_rmsnorm_modulate": {"gated_residual": 3, "rmsnorm_modulate": 2},
    "qk_rmsnorm_rope": {"rope": 2},  # torch.nn.RMSNorm, then our RoPE on attn1's q and k
    "linear_gelu": {"gelu": 1},
}


def tiny_model(dtype, **config):
    model = LTXVideoTransformer3DModel(**{**TINY, **config}).to(dtype).eval()
    return randomize_norms(model, tables=True)


def tiny_inputs(dtype, device="cpu", batch=2, per_token=False):
    """per_token: one timestep per token, as LTXConditionPipeline (LTX-Video 0.9.5 to 0.9.8) passes
    it (conditioning tokens at 0), so the blocks' modulation is [B, S, 6, D]."""
    hidden = torch.randn(
        batch, FRAMES * HEIGHT * WIDTH, TINY["in_channels"], dtype=dtype, device=device
    )
    text = torch.randn(batch, TEXT, TINY["caption_channels"], dtype=dtype, device=device)
    mask = torch.ones(batch, TEXT, dtype=torch.bool, device=device)
    mask[0, TEXT - 2 :] = False
    timestep = torch.randint(0, 1000, (batch,), device=device)
    if per_token:
        timestep = torch.randint(0, 1000, (batch, FRAMES * HEIGHT * WIDTH), device=device)
        timestep[:, : HEIGHT * WIDTH] = 0  # the first frame: conditioning tokens
    return dict(
        hidden_states=hidden,
        encoder_hidden_states=text,
        timestep=timestep,
        encoder_attention_mask=mask,
        num_frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )


def expected_counts(disabled=None, per_token=False):
    """The ltx_kernels ops one forward runs, with op `disabled` left out; per_token: with
    per-token modulation, whose table sum runs on gated_residual in each block."""
    counts = block_op_counts(OPS_PER_BLOCK, FALLBACKS, disabled, TINY["num_layers"])
    if per_token and disabled != "gated_residual":
        counts["gated_residual"] = counts.get("gated_residual", 0) + TINY["num_layers"]
    if disabled != "layernorm_modulate":
        counts["layernorm_modulate"] = 1  # the output norm
    return counts


def full_inputs(batch, frames, height, width, device, dtype=torch.bfloat16, text=128):
    """Inputs of the full-size transformer (LTXVideoTransformer3DModel())."""
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(
        batch, frames * height * width, 128, generator=generator, device=device, dtype=dtype
    )
    prompt = torch.randn(batch, text, 4096, generator=generator, device=device, dtype=dtype)
    mask = torch.ones(batch, text, dtype=torch.bool, device=device)
    mask[:, text // 2 :] = False
    return dict(
        hidden_states=hidden,
        encoder_hidden_states=prompt,
        timestep=torch.full((batch,), 500.0, device=device),
        encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )
