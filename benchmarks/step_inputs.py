"""One denoising step's inputs, one builder per model family, at any size: the keyword arguments of
the transformer's forward as the family's pipeline passes them. tests/model_zoo builds the tiny
models' inputs with them (test sizes, the tests' own random values) and transformer_cases.py the
full-size ones (a pipeline's resolution and text lengths).

Each builder takes the model's config (any mapping: a config dict or `model.config`), `randn(*shape)`
(the caller's random source and dtype; the builder draws its tensors in the order it lists them)
and the sizes; the values that are not random come from the pipeline (timestep 500: mid-schedule),
and a caller whose inputs differ there (random timesteps in the tests) replaces them afterwards.
"""

import torch


def text_mask(batch: int, length: int, valid: int, device, samples=slice(0, 1)):
    """A padded prompt: all tokens valid but those of `samples` (the first sample) from `valid` on."""
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    mask[samples, valid:] = False
    return mask


def ltx_video(config, randn, *, batch, frames, height, width, text, mask, device):
    """LTXPipeline: latent tokens of a frames x height x width grid, the T5 prompt (its mask: `mask`,
    a text_mask), one timestep per sample."""
    return dict(
        hidden_states=randn(batch, frames * height * width, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["caption_channels"]),
        timestep=torch.full((batch,), 500.0, device=device),
        encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )


def ltx2(
    config,
    randn,
    *,
    batch,
    frames,
    height,
    width,
    audio_frames,
    text,
    valid_text,
    timestep,
    image_to_video,
    device,
):
    """LTX2Pipeline: video latents of a frames x height x width grid and `audio_frames` audio latents,
    each stream's text (2.3+ project the text outside the transformer: it comes in each stream's
    width), a padded text mask, the timestep `timestep` [B] and sigma. image_to_video: per-token
    video timesteps [B, S] with the first frame's tokens at 0 (the conditioning image, as
    LTX2ImageToVideoPipeline passes them) and, where the release has it, the keyframe mask."""
    tokens = frames * height * width
    projected = not config["use_prompt_embeddings"]
    caption = config["caption_channels"]
    video_text = config["num_attention_heads"] * config["attention_head_dim"]
    audio_text = config["audio_num_attention_heads"] * config["audio_attention_head_dim"]
    mask = text_mask(batch, text, valid_text, device).float()
    inputs = dict(
        hidden_states=randn(batch, tokens, config["in_channels"]),
        audio_hidden_states=randn(batch, audio_frames, config["audio_in_channels"]),
        encoder_hidden_states=randn(batch, text, video_text if projected else caption),
        audio_encoder_hidden_states=randn(batch, text, audio_text if projected else caption),
        timestep=timestep,
        sigma=timestep / 1000,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        audio_num_frames=audio_frames,
        fps=24.0,
        use_cross_timestep=config["cross_attn_mod"],  # the pipelines' default (2.3+ behaviour)
        return_dict=False,
    )
    if image_to_video:
        first_frame = torch.arange(tokens, device=device) < height * width
        inputs.update(timestep=timestep[:, None] * ~first_frame, audio_timestep=timestep)
        if config.get("use_keyframes_abs_pos_embedding", False):
            inputs["video_keyframes_mask"] = first_frame[None, :, None].expand(batch, -1, 1).float()
    return inputs


def wan(config, randn, *, batch, frames, height, width, text, timestep):
    """WanPipeline: latents [B, C, F, H, W] (H, W in latent pixels: 2x2 patches a token), the T5
    prompt; timestep() gives the timestep (drawn between the two, as the tests draw it)."""
    return dict(
        hidden_states=randn(batch, config["in_channels"], frames, height, width),
        timestep=timestep(),
        encoder_hidden_states=randn(batch, text, config["text_dim"]),
        return_dict=False,
    )


def image_ids(height, width, device="cpu"):
    """FLUX's image token positions (0, row, column), [height * width, 3], fp32."""
    rows, cols = torch.meshgrid(
        torch.arange(height, device=device), torch.arange(width, device=device), indexing="ij"
    )
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def flux(config, randn, *, batch, height, width, text, timestep, ids_dtype, device):
    """FluxPipeline: packed latent tokens of a height x width grid, the T5 prompt and the pooled
    CLIP embedding, timestep() (drawn after them), the image and text positions (text at 0) in
    ids_dtype and, where the model embeds it, the guidance 3.5."""
    inputs = dict(
        hidden_states=randn(batch, height * width, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["joint_attention_dim"]),
        pooled_projections=randn(batch, config["pooled_projection_dim"]),
        timestep=timestep(),
        img_ids=image_ids(height, width, device).to(ids_dtype),
        txt_ids=torch.zeros(text, 3, device=device, dtype=ids_dtype),
        return_dict=False,
    )
    if config.get("guidance_embeds", False):
        inputs["guidance"] = torch.full((batch,), 3.5, device=device)
    return inputs


def sd3(config, randn, *, batch, side, text, timestep):
    """StableDiffusion3Pipeline: latents [B, C, side, side], the joint CLIP + T5 prompt and the
    pooled CLIP embeddings, timestep() (drawn after them)."""
    return dict(
        hidden_states=randn(batch, config["in_channels"], side, side),
        encoder_hidden_states=randn(batch, text, config["joint_attention_dim"]),
        pooled_projections=randn(batch, config["pooled_projection_dim"]),
        timestep=timestep(),
        return_dict=False,
    )


def hunyuan_video15(
    config,
    randn,
    *,
    batch,
    frames,
    height,
    width,
    text,
    text_2,
    image_tokens,
    image,
    timestep,
    masks,
):
    """HunyuanVideo15Pipeline: latents [B, C, F, H, W], the Qwen and ByT5 prompts with their masks
    (`masks`: the two, padded), and the image tokens image(*shape) (random, or zeros for
    text-to-video)."""
    return dict(
        hidden_states=randn(batch, config["in_channels"], frames, height, width),
        timestep=timestep,
        encoder_hidden_states=randn(batch, text, config["text_embed_dim"]),
        encoder_attention_mask=masks[0],
        encoder_hidden_states_2=randn(batch, text_2, config["text_embed_2_dim"]),
        encoder_attention_mask_2=masks[1],
        image_embeds=image(batch, image_tokens, config["image_embed_dim"]),
        return_dict=False,
    )
