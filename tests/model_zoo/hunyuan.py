"""HunyuanVideo and HunyuanVideo-1.5: tiny transformers (diffusers' own test configs, head_dim 16 and
RoPE axes (4, 6, 6)) with their inputs (padded text masks; HunyuanVideo T2V, I2V latent_concat and
token_replace; HunyuanVideo-1.5 t2v and i2v) and the ltx_kernels ops one injected forward runs;
FramePack (HunyuanVideo's blocks) with the same config."""

import torch
from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel

import bench_utils
import step_inputs
from inject_helpers import randomize_norms
from ltx_kernels.integration import FUSIONS

HUNYUAN_VIDEO = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    patch_size=1,
    patch_size_t=1,
    guidance_embeds=True,
    text_embed_dim=16,
    pooled_projection_dim=8,
    rope_axes_dim=(4, 6, 6),
)
# HunyuanVideo I2V: the image latents concatenated to the noise (33 channels at full size), or the
# first frame's tokens with their own modulation (the token-replace blocks).
LATENT_CONCAT = dict(in_channels=9, guidance_embeds=False, image_condition_type="latent_concat")
TOKEN_REPLACE = dict(image_condition_type="token_replace")
HUNYUAN_VIDEO_15 = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=16,
    text_embed_2_dim=8,
    image_embed_dim=12,
    rope_axes_dim=(4, 6, 6),
    target_size=16,
    task_type="t2v",
)


def config_480p(**overrides) -> dict:
    """HunyuanVideo-1.5 480p's real transformer config (configs/hunyuanvideo-1.5-480p-t2v.json) as
    the full-width tests build it: text-to-video (the file's task_type is "i2v")."""
    config = bench_utils.model_config("hunyuanvideo-1.5-480p-t2v")["transformer"]["config"]
    return {**config, "task_type": "t2v", **overrides}


FRAMEPACK = dict(
    HUNYUAN_VIDEO,
    patch_size=2,
    has_image_proj=True,
    image_proj_dim=16,
    has_clean_x_embedder=True,
)
TEXT = 6


def expected_ops(ops, double: int, single: int, token_replace: bool = False) -> dict:
    """ltx_kernels op calls per forward of a HunyuanVideo(-1.5) model with `double` double and
    `single` single blocks and `ops` enabled: each step runs its op, or the op of its fallback
    (the unfused step's pieces). token_replace: blocks stay stock but for their attention and the
    text stream's norm1_context (AdaLayerNormZero)."""
    ops = set(ops)
    counts = dict.fromkeys(FUSIONS, 0)

    def count(op, n, fallback=None):
        if op in ops:
            counts[op] += n
        elif fallback:
            fallback(n)

    def add_norm_modulate(n):
        count("gated_residual", n)
        count("layernorm_modulate", n)

    count("rmsnorm", 4 * double + 2 * single)  # q, k (+ added q, added k) per attention
    count("rope", 2 * double + 2 * single)  # image q and k per attention
    if token_replace:
        count("layernorm_modulate", double + 1)  # norm1_context, norm_out
    else:
        count("layernorm_modulate", 2 * double + single + 1)  # norm1(_context), norm, norm_out
        count("add_layernorm_modulate", 2 * double, add_norm_modulate)  # x + gate*attn, norm2
        count("gated_residual", 2 * double + single)  # FF residuals, single-block output
        count("linear_gelu", 2 * double + single, lambda n: count("gelu", n))
    return {op: n for op, n in counts.items() if n}


def tiny_model(dtype, v15=False, **config):
    torch.manual_seed(0)
    if v15:
        model = HunyuanVideo15Transformer3DModel(**{**HUNYUAN_VIDEO_15, **config})
    else:
        model = HunyuanVideoTransformer3DModel(**{**HUNYUAN_VIDEO, **config})
    return _freeze_refiner_key_bias(randomize_norms(model.to(dtype).eval()))


def _freeze_refiner_key_bias(model):
    """The token refiner's attention (stock diffusers, no q/k norm) adds its key bias to every key
    alike, which softmax ignores: its gradient is zero but for rounding (~1e-7, others ~1-10),
    noise that test_training's relative comparison cannot match. Frozen, so training tests
    compare the gradients that carry information."""
    for name, parameter in model.named_parameters():
        if "refiner" in name and name.endswith("attn.to_k.bias"):
            parameter.requires_grad_(False)
    return model


def tiny_framepack(dtype):
    from diffusers import HunyuanVideoFramepackTransformer3DModel

    torch.manual_seed(0)
    return randomize_norms(HunyuanVideoFramepackTransformer3DModel(**FRAMEPACK).to(dtype).eval())


def _text_mask(batch, length, padded_sample, valid):
    mask = torch.ones(batch, length)
    mask[padded_sample, valid:] = 0
    return mask


def tiny_inputs(dtype, v15=False, variant=None, batch=2, frames=2, size=4):
    """One forward's keyword arguments; a text sample is padded. HunyuanVideo variants:
    None (T2V), "latent_concat", "token_replace"; HunyuanVideo-1.5: None (t2v), "i2v"."""
    torch.manual_seed(1)
    timestep = torch.tensor([500.0]).expand(batch).to(dtype)
    if v15:  # the model reorders the text valid-first: [image, text_2, text, padding]
        image = torch.randn if variant == "i2v" else torch.zeros  # t2v: all-zero image tokens
        return step_inputs.hunyuan_video15(
            HUNYUAN_VIDEO_15,
            lambda *shape: torch.randn(*shape, dtype=dtype),
            batch=batch,
            frames=frames,
            height=size,
            width=size,
            text=TEXT,
            text_2=4,
            image_tokens=3,
            image=lambda *shape: image(*shape, dtype=dtype),
            timestep=timestep,
            masks=(_text_mask(batch, TEXT, 0, 4), _text_mask(batch, 4, 1, 2)),
        )
    channels = 9 if variant == "latent_concat" else 4
    inputs = dict(
        hidden_states=torch.randn(batch, channels, frames, size, size, dtype=dtype),
        timestep=timestep,
        encoder_hidden_states=torch.randn(batch, TEXT, 16, dtype=dtype),
        encoder_attention_mask=_text_mask(batch, TEXT, 0, 4),
        pooled_projections=torch.randn(batch, 8, dtype=dtype),
        guidance=None
        if variant == "latent_concat"
        else torch.tensor([3500.0]).expand(batch).to(dtype),
        return_dict=False,
    )
    return inputs


def framepack_inputs(dtype, batch=1, frames=3, size=4):
    """FramePack's inputs: the latents with their clean, 2x and 4x history and indices."""
    torch.manual_seed(1)

    def latents(f):
        return torch.randn(batch, 4, f, size, size, dtype=dtype)

    return dict(
        hidden_states=latents(frames),
        timestep=torch.tensor([500.0]).expand(batch).to(dtype),
        encoder_hidden_states=torch.randn(batch, TEXT, 16, dtype=dtype),
        encoder_attention_mask=torch.ones(batch, TEXT),
        pooled_projections=torch.randn(batch, 8, dtype=dtype),
        guidance=torch.tensor([3500.0]).expand(batch).to(dtype),
        image_embeds=torch.randn(batch, TEXT, 16, dtype=dtype),
        indices_latents=torch.arange(frames),
        latents_clean=latents(frames - 1),
        indices_latents_clean=torch.arange(frames - 1),
        latents_history_2x=latents(frames - 1),
        indices_latents_history_2x=torch.arange(frames - 1),
        latents_history_4x=latents((frames - 1) * 4),
        indices_latents_history_4x=torch.arange((frames - 1) * 4),
        return_dict=False,
    )
