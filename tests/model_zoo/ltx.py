"""LTX-Video: the tiny transformer (as diffusers' own model tests build it) with its inputs and the
ltx_kernels ops one injected forward runs; the inputs of the full-size transformer."""

import torch
from diffusers import LTXVideoTransformer3DModel

import step_inputs
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
    """step_inputs.ltx_video with random timesteps. per_token: one timestep per token, as
    LTXConditionPipeline (LTX-Video 0.9.5 to 0.9.8) passes it (conditioning tokens at 0), so the
    blocks' modulation is [B, S, 6, D]."""
    inputs = step_inputs.ltx_video(
        TINY,
        lambda *shape: torch.randn(*shape, dtype=dtype, device=device),
        batch=batch,
        frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        text=TEXT,
        mask=step_inputs.text_mask(batch, TEXT, TEXT - 2, device),
        device=device,
    )
    timestep = torch.randint(0, 1000, (batch,), device=device)
    if per_token:
        timestep = torch.randint(0, 1000, (batch, FRAMES * HEIGHT * WIDTH), device=device)
        timestep[:, : HEIGHT * WIDTH] = 0  # the first frame: conditioning tokens
    inputs["timestep"] = timestep
    return inputs


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
    """Inputs of the full-size transformer (LTXVideoTransformer3DModel()): step_inputs.ltx_video,
    every sample's prompt padded from its middle."""
    generator = torch.Generator(device).manual_seed(0)
    return step_inputs.ltx_video(
        dict(in_channels=128, caption_channels=4096),
        lambda *shape: torch.randn(*shape, generator=generator, device=device, dtype=dtype),
        batch=batch,
        frames=frames,
        height=height,
        width=width,
        text=text,
        mask=step_inputs.text_mask(batch, text, text // 2, device, samples=slice(None)),
        device=device,
    )
