"""Wan 2.x: the tiny transformer (diffusers' own test config), as users load it (bf16 with
`_keep_in_fp32_modules` kept fp32), with its inputs (T2V, I2V, Wan 2.2 TI2V) and the ltx_kernels
ops one injected forward runs; SkyReels-V2 (Wan's math), ChronoEdit and Wan-Animate (Wan's block
copied) with the same config."""

import torch
from diffusers import WanTransformer3DModel

import step_inputs
from inject_helpers import block_op_counts, randomize_norms

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=256,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)
I2V = dict(image_dim=8, added_kv_proj_dim=24)  # added_kv_proj_dim = inner dim, as the real config
LAYERS = TINY["num_layers"]
FRAMES, HEIGHT, WIDTH = 2, 8, 8
TOKENS = FRAMES * HEIGHT * WIDTH // 4
# Per block: norm1; q/k of attn1 (+ RoPE) and attn2; attn1 residual + norm2; attn2 residual +
# norm3; FF; FF residual.
OPS_PER_BLOCK = {
    "layernorm_modulate": 1,
    "qk_rmsnorm_rope": 2,
    "add_layernorm_modulate": 2,
    "linear_gelu": 1,
    "gated_residual": 1,
}
# The counts of a block that change when one op is disabled.
FALLBACKS = {
    # gated residual + norm2, x + a2 (eager) + norm3
    "add_layernorm_modulate": {"gated_residual": 2, "layernorm_modulate": 3},
    "qk_rmsnorm_rope": {"rope": 2},  # torch.nn.RMSNorm, then our RoPE on attn1's q and k
    "linear_gelu": {"gelu": 1},
}


def randomize(model):
    """Norm weights/biases and modulation tables away from their init values."""
    return randomize_norms(model, tables=True, bias_mean=0.0)


def load_as(model, dtype):
    """The model as from_pretrained(torch_dtype=dtype) loads it (test_load_as checks): cast, with
    the `_keep_in_fp32_modules` (tables, norm1/2/3, RoPE, time embedder) left in fp32."""
    keep = model._keep_in_fp32_modules

    def kept(named):
        return {name: t.data for name, t in named if any(m in name.split(".") for m in keep)}

    fp32 = {**kept(model.named_parameters()), **kept(model.named_buffers())}
    model.to(dtype)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name in fp32:
            tensor.data = fp32[name]
    return model.eval()


def tiny_model(dtype, cls=WanTransformer3DModel, **config):
    return load_as(randomize(cls(**{**TINY, **config})), dtype)


def layers_of_1_3b(dtype, layers=2, device="cuda"):
    """(model, inputs): Wan 2.1 1.3B's dimensions with `layers` of its 30 layers, loaded as
    `dtype`, and one forward's inputs at 81 frames of 480x832 (32760 tokens), on `device`."""
    with torch.device(device):
        model = WanTransformer3DModel(
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            ffn_dim=8960,
            num_layers=layers,
        )
    model = load_as(randomize(model), dtype)
    generator = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(
            1, 16, 21, 60, 104, generator=generator, device=device, dtype=dtype
        ),
        timestep=torch.tensor([500.0], device=device),
        encoder_hidden_states=torch.randn(
            1, 512, 4096, generator=generator, device=device, dtype=dtype
        ),
        return_dict=False,
    )
    return model, inputs


def tiny_skyreels(dtype, **config):
    """SkyReels-V2 (Wan's math under its own classes), with the same tiny config."""
    from diffusers import SkyReelsV2Transformer3DModel

    return tiny_model(dtype, cls=SkyReelsV2Transformer3DModel, **config)


def tiny_chronoedit(dtype, **config):
    """ChronoEdit (image editing as Wan 2.1 I2V, with its own copies of Wan's block, attention and
    processor, and its own RoPE), with the same tiny config and Wan's I2V image inputs."""
    from diffusers import ChronoEditTransformer3DModel

    return tiny_model(dtype, cls=ChronoEditTransformer3DModel, **{**I2V, **config})


# Wan-Animate's extras at toy sizes: 4 pose channels (the latent's), a 16-pixel face video through
# a 3-level motion encoder, the face adapter after every block.
ANIMATE = dict(
    in_channels=12,
    latent_channels=4,
    motion_encoder_size=16,
    motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
    motion_style_dim=16,
    motion_dim=4,
    motion_encoder_dim=16,
    face_encoder_hidden_dim=16,
    face_encoder_num_heads=2,
    inject_face_latents_blocks=1,
    motion_encoder_batch_size=4,
)


def tiny_wan_animate(dtype, **config):
    """Wan-Animate (Wan 2.2 Animate: its own copies of Wan's block, attention and processor, plus
    pose embedding, motion/face encoders and face adapters, which stay stock)."""
    from diffusers import WanAnimateTransformer3DModel

    return tiny_model(dtype, cls=WanAnimateTransformer3DModel, **{**I2V, **ANIMATE, **config})


def tiny_animate_inputs(dtype, batch=2):
    """Wan-Animate's inputs: I2V's, with the reference latents' channels, pose latents for all but
    the first frame and a face video."""
    inputs = tiny_inputs(dtype, variant="i2v", batch=batch)
    inputs["hidden_states"] = torch.randn(batch, 12, FRAMES, HEIGHT, WIDTH, dtype=dtype)
    inputs["pose_hidden_states"] = torch.randn(batch, 4, FRAMES - 1, HEIGHT, WIDTH, dtype=dtype)
    inputs["face_pixel_values"] = torch.randn(batch, 3, FRAMES, 16, 16, dtype=dtype)
    return inputs


def tiny_inputs(dtype, variant="t2v", batch=2):
    """variant: t2v, i2v, ti2v (Wan 2.2: a timestep per token) or diffusion_forcing (SkyReels-V2:
    a timestep per frame, temb [B, 6, S, D], a causal self-attention mask)."""
    inputs = step_inputs.wan(
        TINY,
        lambda *shape: torch.randn(*shape, dtype=dtype),
        batch=batch,
        frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        text=512 if variant == "i2v" else 12,  # I2V splits the context at 512 - image tokens
        timestep=lambda: torch.randint(0, 1000, (batch,)),
    )
    if variant == "i2v":
        inputs["encoder_hidden_states_image"] = torch.randn(batch, 4, I2V["image_dim"], dtype=dtype)
    if variant == "ti2v":  # Wan 2.2 TI2V: one timestep per token
        inputs["timestep"] = torch.randint(0, 1000, (batch, TOKENS))
    if variant == "diffusion_forcing":
        inputs["timestep"] = torch.randint(0, 1000, (batch, FRAMES))
        inputs["enable_diffusion_forcing"] = True
    return inputs


def expected_counts(disabled=None, layers=LAYERS):
    """The ltx_kernels ops one forward runs, with op `disabled` left out."""
    return block_op_counts(OPS_PER_BLOCK, FALLBACKS, disabled, layers)


def chronoedit_counts(disabled=None, layers=LAYERS):
    """expected_counts for ChronoEdit in bf16: its RoPE tables are not among the modules it keeps in
    fp32, so they are bf16 and the rope op is left out (Wan's own rotation runs): without the q/k
    norm op, no rope either."""
    return block_op_counts(OPS_PER_BLOCK, {**FALLBACKS, "qk_rmsnorm_rope": {}}, disabled, layers)
