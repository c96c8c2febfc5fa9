"""Full-size diffusers transformers for the whole-model benchmarks: each model family at its real
config (configs/*.json, random weights, bf16) with the inputs its pipeline gives one denoising step
at a typical resolution. `case(name, shape)` -> (model, call): `call(model)` runs one step;
`call(model, mask=False)` the same without the text mask (LTX-Video, for context parallelism).

Shapes (latent tokens; the text lengths are the pipelines' own):
  ltx             LTXPipeline, LTX-Video 2B (0.9.1): batch 2 (CFG), 128 text tokens (one padded);
                  2688 = 49 frames 512x768, 8064 = 161 frames, 6144 = 121 frames, 12672 = 257.
  ltx-13b         LTXConditionPipeline, LTX-Video 0.9.8 13B: the same grids with an image
                  condition, so per-token timesteps [B, S] (the first frame's tokens at 0: the
                  blocks' modulation is [B, S, 6, D]) and the pipeline's video_coords.
  ltx2, ltx2.3, ltx2.5
                  LTX2Pipeline (image-to-video: per-token video timesteps), batch 2: 6144 video
                  tokens (121 frames 768x512) + 126 audio latents, 1024 text tokens.
  wan-1.3b, wan-14b
                  WanPipeline, Wan 2.1: batch 1 (diffusers runs the CFG halves one by one),
                  32760 tokens (81 frames 480x832), 512 text tokens.
  flux            FluxPipeline, FLUX.1-dev (19 double + 38 single blocks): batch 1, 4096 image
                  tokens (1024x1024) + 512 text tokens, guidance embedding.
  sd3.5           StableDiffusion3Pipeline, SD3.5 Large: batch 2 (CFG), 4096 image tokens
                  (1024x1024) + 333 text tokens (77 CLIP + 256 T5).
  hunyuanvideo-1.5
                  HunyuanVideo15Pipeline 480p text-to-video: batch 1 (its guider runs the CFG
                  halves one by one), 49290 tokens (121 frames 480x848), 1000 Qwen + 256 ByT5
                  text tokens (padded), 729 all-zero image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import bench_utils

DTYPE = torch.bfloat16

# LTX-Video latent grids (frames, height, width) by token count: VAE 8x temporal, 32x spatial.
LTX_GRIDS = {
    2688: (7, 16, 24),
    6144: (16, 16, 24),
    7392: (21, 16, 22),
    8064: (21, 16, 24),
    12672: (33, 16, 24),
}


@dataclass(frozen=True)
class Case:
    config: str  # configs/<config>.json
    shapes: tuple[int, ...]  # latent token counts it runs (the first: the default)
    inputs: Callable  # (model, tokens, generator) -> the forward's keyword arguments, on the
    # generator's device
    family: str  # what inject_optimized_kernels maps it as (its row of the README's models table)


def _randn(generator, *shape):
    return torch.randn(*shape, generator=generator, device=generator.device).to(DTYPE)


def _text_mask(generator, batch: int, length: int, valid: int):
    """All valid but the first sample, valid for its first `valid` tokens (a padded prompt)."""
    mask = torch.ones(batch, length, dtype=torch.bool, device=generator.device)
    mask[0, valid:] = False
    return mask


def ltx_inputs(model, tokens, generator, per_token=False):
    frames, height, width = LTX_GRIDS[tokens]
    tokens = frames * height * width
    batch, text = 2, 128
    config = model.config
    inputs = dict(
        hidden_states=_randn(generator, batch, tokens, config.in_channels),
        encoder_hidden_states=_randn(generator, batch, text, config.caption_channels),
        timestep=torch.full((batch,), 500.0, device=generator.device),
        encoder_attention_mask=_text_mask(generator, batch, text, 40),
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )
    if per_token:  # LTXConditionPipeline with a first-frame image condition
        first_frame = torch.arange(tokens, device=generator.device) < height * width
        inputs["timestep"] = (500.0 * ~first_frame).float().expand(batch, -1)
        grid = torch.stack(
            torch.meshgrid(
                *(torch.arange(n, device=generator.device) for n in (frames, height, width)),
                indexing="ij",
            )
        ).reshape(1, 3, tokens)
        coords = grid * torch.tensor([8, 32, 32], device=generator.device)[None, :, None]
        coords[:, 0] = (coords[:, 0] + 1 - 8).clamp(min=0)
        coords = coords.float()
        coords[:, 0] /= 25.0  # frame rate
        inputs["video_coords"] = coords.expand(batch, -1, -1)
    return inputs


# 121 frames of 768x512 at 24 fps: 16 x 16 x 24 latent tokens, 126 audio latents, 1024 text tokens.
def ltx2_inputs(model, tokens, generator):
    config = model.config
    frames, height, width = LTX_GRIDS[tokens]
    tokens = frames * height * width
    batch, text, audio = 2, 1024, 126
    projected = not config.use_prompt_embeddings  # 2.3+: the text comes in each stream's width
    video_text = config.num_attention_heads * config.attention_head_dim
    audio_text = config.audio_num_attention_heads * config.audio_attention_head_dim
    timestep = torch.full((batch,), 500.0, device=generator.device)
    first_frame = torch.arange(tokens, device=generator.device) < height * width
    mask = _text_mask(generator, batch, text, 300).float()
    inputs = dict(
        hidden_states=_randn(generator, batch, tokens, config.in_channels),
        audio_hidden_states=_randn(generator, batch, audio, config.audio_in_channels),
        encoder_hidden_states=_randn(
            generator, batch, text, video_text if projected else config.caption_channels
        ),
        audio_encoder_hidden_states=_randn(
            generator, batch, text, audio_text if projected else config.caption_channels
        ),
        timestep=timestep[:, None] * ~first_frame,  # image-to-video: per-token video timesteps
        audio_timestep=timestep,
        sigma=timestep / 1000,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        audio_num_frames=audio,
        fps=24.0,
        use_cross_timestep=config.cross_attn_mod,
        return_dict=False,
    )
    if getattr(config, "use_keyframes_abs_pos_embedding", False):
        inputs["video_keyframes_mask"] = first_frame[None, :, None].expand(batch, -1, 1).float()
    return inputs


# Token grids: 81 frames 480x832 -> 21 x 60 x 104 latents (VAE 4x temporal, 8x spatial), 2x2 patches.
WAN_GRIDS = {32760: (21, 30, 52)}


def wan_inputs(model, tokens, generator):
    frames, height, width = WAN_GRIDS[tokens]
    patch = model.config.patch_size
    return dict(
        hidden_states=_randn(
            generator, 1, model.config.in_channels, frames, height * patch[1], width * patch[2]
        ),
        timestep=torch.tensor([500.0], device=generator.device),
        encoder_hidden_states=_randn(generator, 1, 512, model.config.text_dim),
        return_dict=False,
    )


def flux_inputs(model, tokens, generator):
    side, text = int(round(tokens**0.5)), 512
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = (
        torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(generator.device)
    )
    config = model.config
    return dict(
        hidden_states=_randn(generator, 1, tokens, config.in_channels),
        encoder_hidden_states=_randn(generator, 1, text, config.joint_attention_dim),
        pooled_projections=_randn(generator, 1, config.pooled_projection_dim),
        timestep=torch.tensor([0.5], device=generator.device, dtype=DTYPE),
        img_ids=img_ids.to(DTYPE),
        txt_ids=torch.zeros(text, 3, device=generator.device, dtype=DTYPE),
        guidance=torch.tensor([3.5], device=generator.device),
        return_dict=False,
    )


def sd3_inputs(model, tokens, generator):
    config = model.config
    side = int(round(tokens**0.5)) * config.patch_size
    return dict(
        hidden_states=_randn(generator, 2, config.in_channels, side, side),
        encoder_hidden_states=_randn(generator, 2, 77 + 256, config.joint_attention_dim),
        pooled_projections=_randn(generator, 2, config.pooled_projection_dim),
        timestep=torch.tensor([500.0, 500.0], device=generator.device),
        return_dict=False,
    )


# 121 (61) frames 480x848: VAE 4x temporal, 16x spatial.
HUNYUAN15_GRIDS = {49290: (31, 30, 53), 25440: (16, 30, 53)}


def hunyuan15_inputs(model, tokens, generator):
    frames, height, width = HUNYUAN15_GRIDS[tokens]
    config = model.config
    return dict(
        hidden_states=_randn(generator, 1, config.in_channels, frames, height, width),
        timestep=torch.tensor([500.0], device=generator.device, dtype=DTYPE),
        encoder_hidden_states=_randn(generator, 1, 1000, config.text_embed_dim),
        encoder_attention_mask=_text_mask(generator, 1, 1000, 120).to(DTYPE),
        encoder_hidden_states_2=_randn(generator, 1, 256, config.text_embed_2_dim),
        encoder_attention_mask_2=_text_mask(generator, 1, 256, 20).to(DTYPE),
        image_embeds=torch.zeros(
            1, 729, config.image_embed_dim, device=generator.device, dtype=DTYPE
        ),
        return_dict=False,
    )


CASES = {
    "ltx": Case("ltx-video-0.9.1", (2688, 8064, 6144, 7392, 12672), ltx_inputs, "LTX-Video"),
    "ltx-13b": Case(
        "ltx-video-0.9.8-13b-distilled",
        (6144, 2688, 8064, 12672),
        lambda m, t, g: ltx_inputs(m, t, g, per_token=True),
        "LTX-Video",
    ),
    "ltx2": Case("ltx-2", (6144,), ltx2_inputs, "LTX-2"),
    "ltx2.3": Case("ltx-2.3", (6144,), ltx2_inputs, "LTX-2"),
    "ltx2.5": Case("ltx-2.5", (6144,), ltx2_inputs, "LTX-2"),
    "wan-1.3b": Case("wan2.1-t2v-1.3b", (32760,), wan_inputs, "Wan"),
    "wan-14b": Case("wan2.1-t2v-14b", (32760,), wan_inputs, "Wan"),
    "flux": Case("flux.1-dev", (4096,), flux_inputs, "FLUX"),
    "sd3.5": Case("sd3.5-large", (4096,), sd3_inputs, "SD3"),
    "hunyuanvideo-1.5": Case(
        "hunyuanvideo-1.5-480p-t2v", (49290, 25440), hunyuan15_inputs, "HunyuanVideo-1.5"
    ),
}


def build(name: str, tokens: int | None = None, seed: int = 0, device="cuda", **overrides):
    """(model, call, tokens): the case's full-size model (its config with `overrides`, e.g. fewer
    layers) with random weights on `device`, and one step's call at `tokens` (the case's default
    when None)."""
    import diffusers

    spec = CASES[name]
    tokens = tokens or spec.shapes[0]
    if tokens not in spec.shapes:
        raise ValueError(f"{name}: --tokens {tokens} is not one of {spec.shapes}")
    config = bench_utils.model_config(spec.config)["transformer"]
    model = bench_utils.random_model(
        getattr(diffusers, config["class"]), {**config["config"], **overrides}, DTYPE, device, seed
    )
    generator = torch.Generator(device).manual_seed(seed)
    inputs = spec.inputs(model, tokens, generator)

    def call(m, mask=True):  # mask=False: without the text mask (LTX-Video)
        kwargs = inputs if mask else {**inputs, "encoder_attention_mask": None}
        return m(**kwargs)[0]

    return model, call, tokens
