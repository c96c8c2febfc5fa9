"""HunyuanVideo and HunyuanVideo-1.5: tiny transformers (diffusers' own test configs, head_dim 16 and
RoPE axes (4, 6, 6)) and their inputs, with padded text masks. Not mapped yet beyond the generic
AdaLN patches (integration/adaln.py), which their blocks use; their patch embedding hands block 0 a
transposed view, which the fused steps must leave to the diffusers code."""

import torch

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


def tiny_model(dtype, v15=False):
    from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    if v15:
        return HunyuanVideo15Transformer3DModel(**HUNYUAN_VIDEO_15).to(dtype).eval()
    return HunyuanVideoTransformer3DModel(**HUNYUAN_VIDEO).to(dtype).eval()


def tiny_inputs(dtype, v15=False, batch=2, frames=2, size=4):
    """One forward's keyword arguments; the first sample's text is padded."""
    text = torch.ones(batch, 6)
    text[0, 4:] = 0
    inputs = dict(
        hidden_states=torch.randn(batch, 4, frames, size, size, dtype=dtype),
        timestep=torch.tensor([500.0]).expand(batch).to(dtype),
        encoder_hidden_states=torch.randn(batch, 6, 16, dtype=dtype),
        encoder_attention_mask=text,
        return_dict=False,
    )
    if v15:
        text_2 = torch.ones(batch, 4)
        text_2[1, 2:] = 0
        inputs.update(
            encoder_hidden_states_2=torch.randn(batch, 4, 8, dtype=dtype),
            encoder_attention_mask_2=text_2,
            image_embeds=torch.zeros(batch, 3, 12, dtype=dtype),
        )
    else:
        inputs.update(
            pooled_projections=torch.randn(batch, 8, dtype=dtype),
            guidance=torch.tensor([3500.0]).expand(batch).to(dtype),
        )
    return inputs
