"""Full-size diffusers transformers for the whole-model benchmarks: each model family at its real
config (configs/*.json, random weights, bf16) with the inputs its pipeline gives one denoising step
at a typical resolution. `build(name, tokens)` -> (model, call, tokens): `call(model)` runs one
step; `call(model, mask=False)` the same without the text mask (LTX-Video, for context
parallelism). `model_case` also builds the FLUX block pair ("flux-pair"). The columns
benchmark_transformer.py, profile_step.py and benchmark_training.py time are set up by
`configured(column, model)` (kernels, FP8, torchao, compiled whole or per block).

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
                  32760 tokens (81 frames 480x832), 75600 (81 frames 720x1280), 512 text tokens.
  flux            FluxPipeline, FLUX.1-dev (19 double + 38 single blocks): batch 1, 4096 image
                  tokens (1024x1024) + 512 text tokens, guidance embedding.
  sd3.5           StableDiffusion3Pipeline, SD3.5 Large: batch 2 (CFG), 4096 image tokens
                  (1024x1024) + 333 text tokens (77 CLIP + 256 T5).
  hunyuanvideo-1.5
                  HunyuanVideo15Pipeline 480p text-to-video: batch 1 (its guider runs the CFG
                  halves one by one), 49290 tokens (121 frames 480x848; 48360: 480x832, which
                  4 GPUs divide), 1000 Qwen + 256 ByT5 text tokens (padded), 729 all-zero image
                  tokens.

`denoising_pipeline` holds a model in its diffusers pipeline (no encoders, VAE or scheduler) with
guidance on, and `guided_step` runs the transformer calls of one guided denoising step as that
pipeline makes them (its cache contexts): what enable_cfg_parallel splits over the GPU groups.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

import bench_utils
import ltx_kernels
import step_inputs
from ltx_kernels.integration import FUSIONS

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


def ltx_inputs(model, tokens, generator, per_token=False):
    frames, height, width = LTX_GRIDS[tokens]
    tokens = frames * height * width
    batch, device = 2, generator.device
    inputs = step_inputs.ltx_video(
        model.config,
        functools.partial(_randn, generator),
        batch=batch,
        frames=frames,
        height=height,
        width=width,
        text=128,
        mask=step_inputs.text_mask(batch, 128, 40, device),
        device=device,
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
    frames, height, width = LTX_GRIDS[tokens]
    return step_inputs.ltx2(
        model.config,
        functools.partial(_randn, generator),
        batch=2,
        frames=frames,
        height=height,
        width=width,
        audio_frames=126,
        text=1024,
        valid_text=300,
        timestep=torch.full((2,), 500.0, device=generator.device),
        image_to_video=True,
        device=generator.device,
    )


# Token grids: 81 frames 480x832 -> 21 x 60 x 104 latents (VAE 4x temporal, 8x spatial), 2x2 patches;
# 720x1280 -> 21 x 90 x 160.
WAN_GRIDS = {32760: (21, 30, 52), 75600: (21, 45, 80)}


def wan_inputs(model, tokens, generator):
    frames, height, width = WAN_GRIDS[tokens]
    patch = model.config.patch_size
    return step_inputs.wan(
        model.config,
        functools.partial(_randn, generator),
        batch=1,
        frames=frames,
        height=height * patch[1],
        width=width * patch[2],
        text=512,
        timestep=lambda: torch.tensor([500.0], device=generator.device),
    )


def flux_inputs(model, tokens, generator):
    side = int(round(tokens**0.5))
    return step_inputs.flux(
        model.config,
        functools.partial(_randn, generator),
        batch=1,
        height=side,
        width=side,
        text=512,
        timestep=lambda: torch.tensor([0.5], device=generator.device, dtype=DTYPE),
        ids_dtype=DTYPE,
        device=generator.device,
    )


def sd3_inputs(model, tokens, generator):
    return step_inputs.sd3(
        model.config,
        functools.partial(_randn, generator),
        batch=2,
        side=int(round(tokens**0.5)) * model.config.patch_size,
        text=77 + 256,
        timestep=lambda: torch.tensor([500.0, 500.0], device=generator.device),
    )


# 121 (61) frames 480x848 (480x832): VAE 4x temporal, 16x spatial.
HUNYUAN15_GRIDS = {49290: (31, 30, 53), 25440: (16, 30, 53), 48360: (31, 30, 52)}


def hunyuan15_inputs(model, tokens, generator):
    frames, height, width = HUNYUAN15_GRIDS[tokens]
    device = generator.device
    return step_inputs.hunyuan_video15(
        model.config,
        functools.partial(_randn, generator),
        batch=1,
        frames=frames,
        height=height,
        width=width,
        text=1000,
        text_2=256,
        image_tokens=729,
        image=lambda *shape: torch.zeros(*shape, device=device, dtype=DTYPE),
        timestep=torch.tensor([500.0], device=device, dtype=DTYPE),
        masks=(
            step_inputs.text_mask(1, 1000, 120, device).to(DTYPE),
            step_inputs.text_mask(1, 256, 20, device).to(DTYPE),
        ),
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
    "wan-1.3b": Case("wan2.1-t2v-1.3b", (32760, 75600), wan_inputs, "Wan"),
    "wan-14b": Case("wan2.1-t2v-14b", (32760, 75600), wan_inputs, "Wan"),
    "flux": Case("flux.1-dev", (4096,), flux_inputs, "FLUX"),
    "sd3.5": Case("sd3.5-large", (4096,), sd3_inputs, "SD3"),
    "hunyuanvideo-1.5": Case(
        "hunyuanvideo-1.5-480p-t2v",
        (49290, 25440, 48360),
        hunyuan15_inputs,
        "HunyuanVideo-1.5",
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


#: The pipeline whose guided step each case's inputs are one call of (cfg_parallel.PIPELINES).
PIPELINES = {
    "ltx": "LTXPipeline",
    "ltx-13b": "LTXConditionPipeline",
    "ltx2": "LTX2Pipeline",
    "ltx2.3": "LTX2Pipeline",
    "ltx2.5": "LTX2Pipeline",
    "wan-1.3b": "WanPipeline",
    "wan-14b": "WanPipeline",
    "hunyuanvideo-1.5": "HunyuanVideo15Pipeline",
}


class LatentsOnlyVae:
    """What HunyuanVideo-1.5's pipelines read of their VAE when they return latents (in their
    constructor, even without a VAE)."""

    temporal_compression_ratio = 4
    spatial_compression_ratio = 16

    def __init__(self, latent_channels: int):
        from types import SimpleNamespace

        self.config = SimpleNamespace(latent_channels=latent_channels)


def denoising_pipeline(pipeline_class, transformer, guidance_scale=3.0, **components):
    """`pipeline_class` (a diffusers video pipeline) holding `transformer` and `components`, the
    other components None (HunyuanVideo-1.5: a LatentsOnlyVae and a ClassifierFreeGuidance guider),
    guidance on at `guidance_scale` (also outside a call: what enable_cfg_parallel's hook reads).
    For a denoising loop on latents (with a scheduler) or one guided step (guided_step)."""
    import inspect

    names = list(inspect.signature(pipeline_class.__init__).parameters)[1:]
    parts = dict.fromkeys(names)
    if "guider" in names:
        from diffusers.guiders import ClassifierFreeGuidance

        channels = (transformer.config.in_channels - 1) // 2  # latents, condition, mask channel
        parts.update(guider=ClassifierFreeGuidance(guidance_scale), vae=LatentsOnlyVae(channels))
    pipe = pipeline_class(**{**parts, "transformer": transformer, **components})
    if "guider" not in names:  # (set again by each pipeline call)
        pipe._guidance_scale = pipe._audio_guidance_scale = guidance_scale
    return pipe


def guided_step(pipe, call):
    """The transformer calls of one guided denoising step of `pipe` (a denoising_pipeline) as the
    pipeline makes them, in its cache contexts (cfg_parallel.PIPELINES): the branches' batched
    call, or one call a branch (the outputs concatenated along the batch). `call(model)` is one
    call's inputs (both branches the same prompt here)."""
    from ltx_kernels.integration.cfg_parallel import PIPELINES as BRANCHES

    branches, model = BRANCHES[type(pipe).__name__], pipe.transformer
    if branches.batched:
        with model.cache_context(branches.batched):
            return call(model)
    outputs = []
    for context in branches.separate:
        with model.cache_context(context):
            outputs.append(call(model))
    return torch.cat(outputs)  # (after the last call: enable_cfg_parallel fills the first's)


def model_case(name: str, tokens: int | None):
    """(model, call, tokens) of a whole model (transformer_cases) or of the FLUX block pair, at
    `tokens` (the model's default shape when None)."""
    if name == "flux-pair":
        return (*flux_pair_case(tokens or 4096), tokens or 4096)
    return build(name, tokens)


class FluxBlockPair(torch.nn.Module):
    """One FLUX.1 double-stream block followed by one single-stream block."""

    def __init__(self):
        super().__init__()
        from diffusers.models.transformers.transformer_flux import (
            FluxSingleTransformerBlock,
            FluxTransformerBlock,
        )

        self.double_block = FluxTransformerBlock(
            dim=3072, num_attention_heads=24, attention_head_dim=128
        )
        self.single_block = FluxSingleTransformerBlock(
            dim=3072, num_attention_heads=24, attention_head_dim=128
        )

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb):
        encoder_hidden_states, hidden_states = self.double_block(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            temb=temb,
            image_rotary_emb=image_rotary_emb,
        )
        encoder_hidden_states, hidden_states = self.single_block(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            temb=temb,
            image_rotary_emb=image_rotary_emb,
        )
        return hidden_states


def flux_rotary(image_side: int, text: int, device):
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    rows, cols = torch.meshgrid(torch.arange(image_side), torch.arange(image_side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
    ids = torch.cat([torch.zeros(text, 3, dtype=img_ids.dtype), img_ids]).to(device).float()
    return FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids)


def flux_pair_case(tokens: int = 4096, text: int = 512):
    side = int(round(tokens**0.5))
    assert side * side == tokens, "flux-pair: --tokens must be a square (image side in patches)"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxBlockPair().to(torch.bfloat16).eval()
    g = torch.Generator("cuda").manual_seed(0)
    args = (
        torch.randn(1, tokens, 3072, generator=g, device="cuda", dtype=torch.bfloat16),
        torch.randn(1, text, 3072, generator=g, device="cuda", dtype=torch.bfloat16),
        torch.randn(1, 3072, generator=g, device="cuda", dtype=torch.bfloat16),
        flux_rotary(side, text, "cuda"),
    )
    return model, lambda m: m(*args)


# The columns of benchmark_transformer.py and profile_step.py: how the model is set up (configured).
COLUMNS = ("eager", "kernels", "blocks", "blocks+kernels", "compile", "compile+kernels")
FP8_COLUMNS = (
    "kernels+fp8",
    "blocks+kernels+fp8",
    "compile+kernels+fp8",
    "torchao-fp8+blocks",
    "torchao-fp8+compile",
)
#: The kernels with our attention op (inject_optimized_kernels(..., attention="ltx_kernels")) and
#: with 8-bit attention (attention="int8"; with fp8 too: the fastest numerics-changing setup).
ATTENTION_COLUMNS = (
    "kernels+ltx_attention",
    "blocks+kernels+ltx_attention",
    "compile+kernels+ltx_attention",
    "kernels+int8_attention",
    "blocks+kernels+int8_attention",
    "kernels+fp8+int8_attention",
    "blocks+kernels+fp8+int8_attention",
)
#: A column's part -> the attention choice it injects with (inject_optimized_kernels' attention=;
#: none of them: "auto").
ATTENTION_PARTS = {
    "ltx_attention": "ltx_kernels",
    "int8_attention": "int8",
    "diffusers_attention": "diffusers",
}
#: Every column benchmark_transformer.py and profile_step.py take (--columns).
ALL_COLUMNS = COLUMNS + FP8_COLUMNS + ATTENTION_COLUMNS


def uncompile_blocks(model):
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None


@contextlib.contextmanager
def configured(column, model):
    """The model set up as `column` ("+"-separated: kernels, fp8, an attention choice of
    ATTENTION_PARTS, torchao-fp8, compiled whole or per block, and no_<fusion> to inject without
    one of FUSIONS, e.g. kernels+no_lora_linear);
    yields what to call, or None when the model has no repeated blocks to compile. Undone on exit."""
    parts = set(column.split("+"))
    injected = "kernels" in parts
    without = {p.removeprefix("no_") for p in parts if p.startswith("no_")}
    with contextlib.ExitStack() as undo:
        if injected:
            ops = set(FUSIONS) - without
            fp8 = "fp8" in parts
            ltx_kernels.inject_optimized_kernels(
                model,
                verbose=False,
                fp8=fp8,
                ops=ops,
                fp8_linears=FP8_LINEARS if fp8 else None,
                attention=next(
                    (choice for part, choice in ATTENTION_PARTS.items() if part in parts), "auto"
                ),
                keep_bf16_weights=fp8,  # (parked on the CPU: the next column gets them back)
            )
            undo.callback(ltx_kernels.remove_optimized_kernels, model)
        if "torchao-fp8" in parts:
            undo.enter_context(bench_utils.torchao_fp8_rowwise(model))
        yield from _compiled(parts, model)


#: torch.compile's mode for the compiled columns (--compile-mode), None: the default.
COMPILE_MODE = None
#: The FP8 preset of the fp8 columns (--fp8-linears: which Linears run FP8), None: the family's.
FP8_LINEARS = None


def _compiled(parts, model):
    torch._dynamo.reset()
    try:
        if "compile" in parts:
            yield torch.compile(model, fullgraph=True, mode=COMPILE_MODE)
        elif "blocks" in parts:
            if not getattr(model, "_repeated_blocks", None):
                yield None
            else:
                model.compile_repeated_blocks(fullgraph=True, mode=COMPILE_MODE)
                yield model
        else:
            yield model
    finally:
        uncompile_blocks(model)
